"""Data parallelism with FSDP2 under `torchrun`: one process per device, one process group.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and
joins the group: gloo on CPU, NCCL on GPUs; without torchrun it is a world of one and nothing
here communicates. `shard(model)` applies `fully_shard` to every decoder layer and then the root,
so parameters, gradients and optimiser state are split over the ranks; it all-gathers in the
compute dtype (`trainer.dtype`) and keeps the parameters float32 (see `World`).

Each rank trains on its own share of a step's sequences. The loss is a token mean over the
whole step (all ranks), so each rank divides its sum by the global token count and scales by the
world size (FSDP averages gradients over ranks). FSDP's forward and backward are collective:
every rank must run the same number of micro-batches, so ranks with fewer run zero-weighted ones
(`pad_micro_batches`).

Launch on a cluster (one process per GPU, the same command on every node):

    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD_NODE:29500 -m codeloop train --config exp.toml

When a rank's process or host dies, the others fail in their next collective; `lost_peer`
turns that failure into one line naming the rank and its address (each rank's address is
gathered when the group is joined), and the run stops: the same command on every node resumes
from the last checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from codeloop.engine.model import default_device, resolve_dtype
from codeloop.errors import CodeloopError, ModelError

T = TypeVar("T")
LEAVE_TIMEOUT_S = 30
# how gloo says a peer is gone: "Connection closed by peer [10.0.0.12]:41129", "Read error
# [10.0.0.12]:41129: Connection reset by peer"
_PEER_GONE = re.compile(r"(?:closed|reset) by peer")
_PEER_ADDRESS = re.compile(r"\[([^\]]+)\]:\d+")
_addresses: list[str] = []  # each rank's address, in rank order (set by `init`)
_broken = False  # a peer was lost: leaving cannot wait for it


class PeerLost(CodeloopError, RuntimeError):
    """Another rank's process or host is gone; the run cannot go on without it."""


@dataclass(frozen=True)
class World:
    """This process's rank, the ranks in all, its device, and the dtype forward and backward
    passes compute in (parameters, gradients and AdamW states stay float32)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype = torch.float32

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Forward passes in `compute_dtype` (a no-op in float32)."""
        enabled = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def launched_main() -> bool:
    """Whether this process is rank 0 of its launch (torchrun's RANK), before `init()`."""
    return os.environ.get("RANK", "0") == "0"


def _leave() -> None:
    """Every rank reaches the end before any tears the group down: a rank whose peer has already
    closed its connections can abort at exit. Bounded wait: a rank that failed never arrives."""
    if dist.is_initialized():
        if dist.get_backend() == "gloo" and not _broken:  # NCCL: no barrier with a timeout
            with contextlib.suppress(Exception):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_TIMEOUT_S))
        dist.destroy_process_group()


def one_process(dtype: str = "float32") -> World:
    """A world of one on the default device (the GPU when there is one), computing in `dtype`
    (`trainer.dtype`)."""
    return World(device=default_device(), compute_dtype=resolve_dtype(dtype))


def init(dtype: str = "float32") -> World:
    """Join torchrun's process group (idempotent); a world of one without torchrun, on the GPU
    when there is one. `dtype`: the compute dtype (`trainer.dtype`)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return one_process(dtype)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        # Left to interpreter exit, the group's threads can outlive it: a rank then aborts
        # ("terminate called without an active exception", exit -6) after its work is done.
        atexit.register(_leave)
        _addresses[:] = all_gather(_own_address(), World(dist.get_rank(), size, device))
    return World(dist.get_rank(), dist.get_world_size(), device, resolve_dtype(dtype))


def _own_address() -> str:
    """The address this host reaches the rendezvous from (where its peers reach it)."""
    master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "1")))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(master)  # UDP: no packet is sent, the route is chosen
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostname()


def rank_address(rank: int) -> str:
    """The address rank `rank` joined the group from ("" outside torchrun)."""
    return _addresses[rank] if rank < len(_addresses) else ""


def lost_peer(err: BaseException) -> PeerLost | None:
    """`err` as a `PeerLost` naming the rank(s) and address that went away, when it is a
    collective's failure because a peer is gone; else None."""
    global _broken
    found = _PEER_ADDRESS.search(str(err))
    if not (_PEER_GONE.search(str(err)) and found and dist.is_initialized()):
        return None
    _broken = True
    address, me = found.group(1), dist.get_rank()
    ranks = [str(r) for r, a in enumerate(_addresses) if a == address and r != me]
    who = f"trainer rank {', '.join(ranks)}" if ranks else "a trainer rank"
    return PeerLost(
        f"lost {who} ({address}): its process or host went down. The run stops here; start "
        "the same command on every node again to resume from the last checkpoint"
    )


def shard(model: Any, world: World) -> Any:
    """FSDP2 over each decoder layer, then the whole model, which moves each rank's shard to its
    device (all-gathers in the compute dtype, gradients reduced in float32); in a world of one,
    the model moved to the world's device."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not world.distributed:
        return model.to(world.device)
    if isinstance(model, FSDPModule):
        return model

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ModelError(
            f"{type(model).__name__} has no .model.layers (decoder layers) for "
            "FSDP to shard over the ranks: run it in one process"
        )
    policy = MixedPrecisionPolicy(param_dtype=world.compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def all_sum(value: float, world: World) -> float:
    if not world.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def all_max(value: int, world: World) -> int:
    if not world.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=world.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def all_mean(metrics: dict[str, float], world: World) -> dict[str, float]:
    """The mean of each metric over ranks (every rank must pass the same keys)."""
    if not world.distributed:
        return metrics
    keys = sorted(metrics)
    tensor = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor)
    return {k: float(v) / world.size for k, v in zip(keys, tensor.tolist(), strict=True)}


def all_gather(value: T, world: World) -> list[T]:
    """Every rank's value, in rank order (pickled: for logs, not tensors)."""
    if not world.distributed:
        return [value]
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, value)
    return gathered


def pad_micro_batches(groups: list[T], world: World) -> list[tuple[T, float]]:
    """(micro-batch, weight): every rank gets as many as the rank with most; extras repeat the
    last one with weight 0 so that FSDP's collectives line up."""
    most = all_max(len(groups), world)
    if not groups and most:
        raise ValueError("pad_micro_batches: a rank with no samples cannot pad (split evenly)")
    padding = [(groups[-1], 0.0)] * (most - len(groups)) if most > len(groups) else []
    return [(g, 1.0) for g in groups] + padding


def full_state_dict(model: Any, world: World, everywhere: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded CPU weights (collective). On every rank for in-process engines (gathered on
    the device first: small models), or only on rank 0 (`everywhere=False`, empty elsewhere)
    for saving, gathered a tensor at a time to the CPU, so no GPU holds the whole model."""
    if not world.distributed:
        return dict(model.state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    state = get_model_state_dict(model, options=options)
    return {k: cast(torch.Tensor, v).cpu() for k, v in state.items()}


def full_optimizer_state(model: Any, optimizer: Any, world: World) -> dict[str, Any] | None:
    """The unsharded optimiser state (collective); None in a world of one (use its own)."""
    if not world.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(get_optimizer_state_dict(model, optimizer, options=options))


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()
