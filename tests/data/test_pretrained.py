"""Importing a GGUF file (SmolLM2's, from the `real` extra) into a transformers directory."""

from pathlib import Path

import pytest

from codeloop.data.pretrained import PretrainedError, import_gguf, smollm2_gguf


@pytest.mark.slow
def test_an_import_leaves_transformers_progress_bars_as_it_found_them(tmp_path: Path) -> None:
    """`codeloop real` runs with transformers' bars off; an import used to turn them on for the
    rest of the run (then every checkpoint printed "Writing model shards" bars)."""
    from transformers.utils import logging

    try:
        gguf = smollm2_gguf()
    except PretrainedError as err:  # make test installs it
        pytest.skip(str(err))
    before = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        out = import_gguf(gguf, tmp_path / "model", quiet=True)
        assert not logging.is_progress_bar_enabled()
    finally:
        if before:
            logging.enable_progress_bar()
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".model.*"))  # the directory written aside was renamed


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PretrainedError, match="nothing.gguf: no such GGUF file"):
        import_gguf(tmp_path / "nothing.gguf", tmp_path / "out")
