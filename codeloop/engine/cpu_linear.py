"""The engine's matrix products on a CPU, with each weight packed once into oneDNN's layout.

`torch.nn.functional.linear` on a CPU hands a weight in PyTorch's layout to the BLAS, which
repacks it into its own blocked layout on every call. A decoding step multiplies every weight
by a few dozen rows, so that repacking is a large share of the product: on a 2-core AMD EPYC
(SmolLM2-135M's projections, 32 rows) float32 products ran at ~95 GFLOP/s and bfloat16 at ~250;
with weights packed once by `torch.ops.mkldnn._reorder_linear_weight` and multiplied by
`torch.ops.mkldnn._linear_pointwise` (the ops torch's own compiler emits for CPU linears),
~170 and ~340, and ~1.3x at the ~200 rows of a step that carries prompt chunks. The results
equal `linear`'s within floating-point rounding (bfloat16: the same values).

`packs` says whether this torch and CPU can (float32 and bfloat16 on a CPU with oneDNN, and a
probe product that matches `linear`); where it cannot, the engine keeps `linear`. A packed
weight is a copy in oneDNN's layout: after new weights arrive, pack them again.
"""

from __future__ import annotations

from functools import cache

import torch

# the rows oneDNN is told to expect when it picks a packed layout: the products it serves run
# from 1 to a few hundred rows; measured the same or better than 32 or 256 for 8 to 512 rows
PACK_ROWS = 64
_DTYPES = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's packed layout, for `linear`."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` for `packed = pack(weight)`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


@cache
def packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` on the CPU can be packed here: oneDNN is built in, its ops
    exist, and a probe product agrees with `torch.nn.functional.linear`."""
    if dtype not in _DTYPES or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    x = torch.randn(3, 32, generator=generator).to(dtype)
    try:
        got = linear(x, pack(weight), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    want = torch.nn.functional.linear(x, weight)
    close = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    return got.shape == want.shape and close
