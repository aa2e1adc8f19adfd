"""The decoding step's attention on a CPU, as a small C kernel compiled on first use.

In a decoding step every row has one query token per head and its own keys, so attention is a
batch of small matrix-vector products. torch's CPU kernels pay for each (row, KV head) pair as
for a block of a large attention: on a 2-core AMD EPYC (bfloat16, SmolLM2's 3 KV heads x 3
queries x 64 dimensions, 64 rows of 330 tokens) SDPA took ~5 ms a layer, half of a slot-cache
decoding step, where reading those keys and values needs ~0.5 ms. `cpu_attention.c` does one
(row, KV head) pair per task: the scores of the group's queries against the row's span of keys,
a float32 softmax, the weighted sum of values; nothing outside a row's span is read, so no mask
is made and no padding is paid for. It took 0.8 ms against SDPA's 3.3 on those shapes, and
the engine's plain generation ran 1.5-1.8x as fast (`codeloop bench rollout`).

The kernel is compiled with the machine's C compiler (`$CC`, else `cc`) for this CPU
(`-O3 -march=native -fopenmp`) into `$CODELOOP_CACHE/kernels/` (default `~/.cache/codeloop`),
once per source, compiler and CPU; its OpenMP runtime is the one torch already loaded.
Where there is no compiler, or it fails, `kernel()` is None (one warning says why) and callers
keep torch's SDPA: the same results within floating-point rounding, at its speed. Float32 and
bfloat16, head sizes a multiple of 16 up to 512 (`Kernel.handles`); anything else is for SDPA
as well.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from codeloop.data.pretrained import cache_dir

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
MAX_DIM, MAX_GROUP, LANES = 512, 16, 16  # as the kernel's
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
log = logging.getLogger(__name__)


class Kernel:
    """The compiled kernel's two entry points (bfloat16, float32), called on tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.entries, self.chunk_entries = {}, {}
        for dtype, name in _DTYPES.items():
            entry = getattr(library, f"decode_attention_{name}")
            entry.argtypes = [p, p, p, p, p, p, p, i, i, i, i, i, i, ctypes.c_float, ctypes.c_int]
            entry.restype = ctypes.c_int
            self.entries[dtype] = entry
            chunked = getattr(library, f"chunk_attention_{name}")
            chunked.argtypes = [p] * 9 + [i] * 6 + [ctypes.c_float, ctypes.c_int]
            chunked.restype = ctypes.c_int
            self.chunk_entries[dtype] = chunked

    def handles(self, dtype: torch.dtype, head_dim: int, group: int) -> bool:
        """Whether the kernel takes a model of this dtype, head size and query heads per KV
        head (float32 or bfloat16; a multiple of 16 up to MAX_DIM; at most MAX_GROUP); else
        SDPA does."""
        return (
            dtype in self.entries
            and head_dim % LANES == 0
            and head_dim <= MAX_DIM
            and 1 <= group <= MAX_GROUP
        )

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        starts: torch.Tensor,
        ends: torch.Tensor,
        scale: float,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [n, KVH, G, D]; keys and values [slots, KVH, columns, D] (the same strides,
        each head's columns contiguous), all on the CPU; row b attends to columns
        starts[b] <= c < ends[b] (int64 [n]) of slot `slots[b]` (int64 [n]; None: slot b).
        Returns [n, KVH, G, D] in query's dtype."""
        query = query.contiguous()
        n, kv_heads, group, dim = query.shape
        out = torch.empty_like(query)
        starts, ends = starts.contiguous(), ends.contiguous()
        slots = None if slots is None else slots.contiguous()
        failed = self.entries[query.dtype](
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
            None if slots is None else slots.data_ptr(),
            starts.data_ptr(), ends.data_ptr(), n, kv_heads, group, dim,
            keys.stride(0), keys.stride(1), scale, torch.get_num_threads(),
        )  # fmt: skip
        if failed:  # 1: shapes `handles` refuses; 2: out of memory
            raise RuntimeError(f"cpu_attention: the kernel refused {tuple(query.shape)} ({failed})")
        return out

    def chunks(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        out: torch.Tensor,
        chunks: torch.Tensor,
        starts: torch.Tensor,
        ends: torch.Tensor,
        scale: float,
    ) -> None:
        """Into `out` [n, KVH, G, D] (query's shape, contiguous), the attention of the rows of
        `chunks` (int64 [c, 3]: first row, end row, slot: consecutive tokens of one slot), row
        b over columns starts[b] <= col < ends[b] of its chunk's slot; other rows of `out` are
        left as they are."""
        query = query.contiguous()
        n, kv_heads, group, dim = query.shape
        firsts, lasts, slots = (chunks[:, i].contiguous() for i in range(3))
        failed = self.chunk_entries[query.dtype](
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
            firsts.data_ptr(), lasts.data_ptr(), slots.data_ptr(), starts.data_ptr(),
            ends.data_ptr(), len(chunks), kv_heads, group, dim, keys.stride(0), keys.stride(1),
            scale, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise RuntimeError(f"cpu_attention: the kernel refused {tuple(query.shape)} ({failed})")


def _machine() -> str:
    """What the compiled code depends on: the CPU's model and flags (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, target: Path) -> None:
    """Compile SOURCE into `target`, atomically (another process may be doing the same)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            raise OSError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-400:]}")
        os.replace(built, target)


@cache
def kernel() -> Kernel | None:
    """The compiled kernel, or None (and one warning) where it cannot be built or loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning(
            "no C compiler (cc) found: decoding on the CPU uses torch's attention, ~1.5x slower; "
            "install one (e.g. gcc) for the faster kernel"
        )
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), compiler, version, *FLAGS, _machine()]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"cpu_attention-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, target)
        return Kernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning(
            "the CPU attention kernel could not be built (%s): decoding uses torch's attention",
            err,
        )
        return None
