"""`trainer.dtype = native`: bfloat16 only where the CPU has bfloat16 instructions; on an AVX2
CPU torch's bfloat16 matmul runs ~8x slower than float32's."""

from pathlib import Path

import pytest
import torch

from codeloop.engine import model
from codeloop.engine.model import cpu_has_bf16, resolve_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(("cpuinfo", "has"), [(AVX2, False), (AMX, True), (ARM, True)])
def test_bfloat16_instructions_are_read_from_the_cpu_flags(
    tmp_path: Path, cpuinfo: str, has: bool
) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert cpu_has_bf16(str(path)) is has


def test_without_cpuinfo_there_is_no_bfloat16(tmp_path: Path) -> None:
    assert cpu_has_bf16(str(tmp_path / "absent")) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU computes in bfloat16 either way")
def test_native_is_bfloat16_on_a_cpu_only_with_its_instructions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model, "cpu_has_bf16", lambda: False)
    assert resolve_dtype("native") == torch.float32
    monkeypatch.setattr(model, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("native") == torch.bfloat16
    assert resolve_dtype("auto") == torch.float32  # auto stays float32 on any CPU
    assert resolve_dtype("bfloat16") == torch.bfloat16  # what is asked for, everywhere
