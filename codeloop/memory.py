"""Give freed host memory back to the system when a training process holds too much.

On a CPU, training steps allocate and free gigabytes of activations of shapes that change with
every batch; glibc's allocator keeps much of what is freed, fragmented, so the resident size of
a SmolLM2 SFT run grew by ~0.3 GB a step (2 cores, 24 GB) until the kernel killed it at 24 GB
(the live memory of a step was ~2 GB). `trim_when_above` asks glibc to return its free memory
(`malloc_trim`) once the process holds more than a share of the machine's memory: a trim costs
a few seconds of page faults afterwards, so it runs only when needed. Elsewhere (no glibc, no
/proc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only where a GPU is asked about
    import torch

TRIM_SHARE = 0.4  # of the machine's memory held by this process before freed memory is returned

LOGITS_COPIES = 4  # float32 [tokens, vocabulary] tensors of a training pass: the output
# layer's, log-softmax's and the gradients of both (the output layer's share of the FLOPs and
# of the memory grows with the vocabulary: 49,152 for SmolLM2, 262,144 for Gemma 3)
ACTIVATION_WIDTHS = 16  # hidden-sized float32 tensors a layer keeps for backward, a token (and
# 4 intermediate-sized ones): by this count 8,192-token micro-batches take SmolLM2 to ~24 GB,
# where they were seen past 20 GB (measured: 16 x 230 tokens took 7.3 GiB over the weights)
MICRO_BATCH_SHARE = 0.5  # of the memory free at a run's first update, for one micro-batch
MICRO_BATCH_CAP = 16384  # tokens: the most an automatic micro-batch holds


def training_bytes_per_token(config: object, checkpointed: bool = False) -> tuple[int, int]:
    """A training pass's bytes a token of a micro-batch, for a model of `config` (a
    transformers config): (its activations, its logits), float32. `checkpointed` (gradient
    checkpointing): every layer keeps its input, one layer at a time the rest."""
    layers = int(getattr(config, "num_hidden_layers", 0))
    hidden = int(getattr(config, "hidden_size", 0))
    intermediate = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    layer = 4 * (ACTIVATION_WIDTHS * hidden + 4 * intermediate)
    activations = 4 * hidden * layers + layer if checkpointed else layer * layers
    return activations, LOGITS_COPIES * 4 * int(getattr(config, "vocab_size", 0))


def micro_batch_tokens(config: object, free: int, checkpointed: bool = False) -> int:
    """The tokens a micro-batch may hold when `free` bytes are free (MICRO_BATCH_SHARE of them
    for its activations and logits, at most MICRO_BATCH_CAP, at least 256)."""
    per_token = max(1, sum(training_bytes_per_token(config, checkpointed)))
    return max(256, min(MICRO_BATCH_CAP, int(MICRO_BATCH_SHARE * free) // per_token))


def _libc() -> ctypes.CDLL | None:
    try:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc cannot say)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def total_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def trim_when_above(share: float = TRIM_SHARE) -> bool:
    """Return freed memory to the system if this process holds more than `share` of the
    machine's memory; True when it trimmed."""
    total = total_bytes()
    if _LIBC is None or not total or resident_bytes() <= share * total:
        return False
    _LIBC.malloc_trim(0)
    return True


def free_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` (a torch device: the GPU's free memory, or
    the machine's available memory)."""
    if device.type == "cuda":
        import torch  # only where a GPU is asked about

        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory()


def available_memory() -> int:
    """Bytes the machine can still give (MemAvailable: free plus reclaimable caches)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
