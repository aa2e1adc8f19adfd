"""Importing a GGUF file (SmolLM2's, from the `real` extra) into a transformers directory."""

import importlib.machinery
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


def test_gemma3_is_assembled_from_its_parts_imported_once_and_the_gguf_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `gemma3` extra's package (faked: it assembles a file) is found, its GGUF assembled
    under the cache, imported, and deleted; the imported directory is reused after."""
    import sys
    import types

    from codeloop.data import pretrained

    assembled: list[Path] = []

    def assemble(target: Path, overwrite: bool = False) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"GGUF")
        assembled.append(target)
        return target

    fake = types.ModuleType(pretrained.GEMMA3_PACKAGE)
    fake.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"  # type: ignore[attr-defined]
    fake.assemble = assemble  # type: ignore[attr-defined]
    fake.__file__ = str(tmp_path / "pkg" / "__init__.py")
    fake.__spec__ = importlib.machinery.ModuleSpec(pretrained.GEMMA3_PACKAGE, None)
    monkeypatch.setitem(sys.modules, pretrained.GEMMA3_PACKAGE, fake)
    monkeypatch.setenv("CODELOOP_CACHE", str(tmp_path / "cache"))
    imports: list[tuple[Path, Path]] = []

    def import_gguf(gguf: Path, out: Path, quiet: bool = False) -> Path:
        assert gguf.read_bytes() == b"GGUF"  # the assembled file, still there while imported
        imports.append((gguf, out))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(pretrained, "import_gguf", import_gguf)
    out = pretrained.packaged("gemma3-270m")(quiet=True)
    assert out == tmp_path / "cache" / "models" / "gemma-3-270m"
    assert imports == [(tmp_path / "cache" / "gguf" / "gemma-3-270m-q4_k_m.gguf", out)]
    assert not assembled[0].exists()  # 253 MB not kept beside the imported model
    assert pretrained.gemma3_270m(quiet=True) == out and len(imports) == 1  # reused
