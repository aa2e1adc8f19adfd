"""LoRA adapters on the inference side: merged into the weights a model samples with.

A LoRA policy (`trainer.lora`, `trainer/lora.py`) trains, for each adapted linear layer
`M` (a parameter `M.weight` of shape (out, in)), two matrices `M.lora_A.weight` (rank, in) and
`M.lora_B.weight` (out, rank); the layer then computes with `W + scaling * B @ A`, `scaling` =
alpha / rank. `merged` computes those weights from the base ones, `fingerprint` names a base
model (whatever dtype it is held in), and `AdapterBase` keeps a server's base weights so that
each pushed adapter is merged into them, not into the last merge.

Nothing here needs peft: `codeloop serve`, `codeloop eval --model` and the in-process engine
merge adapters with these functions; only training attaches them with peft.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from codeloop.errors import ModelError

SCALING, BASE = "lora_scaling", "lora_base"  # a pushed adapter's safetensors metadata
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's
BASE_RECORD = "codeloop_lora.json"  # beside them: the base model's path and fingerprint
PEFT_PREFIX = "base_model.model."  # peft's names for an adapter's tensors start with it
SAMPLED = 4096  # values of each tensor a fingerprint reads
ADAPTER = "default"  # peft's name for the one adapter


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """A short digest of a model's weights: each tensor's name, shape and 4,096 evenly spaced
    values rounded to bfloat16 (so a base held in float32 by the trainer and in bfloat16 by a
    server has one fingerprint). Adapter tensors (names with `.lora_`) are left out."""
    digest = hashlib.sha256()
    for name in sorted(state):
        if ".lora_" in name:
            continue
        tensor = state[name].detach()
        flat = tensor.reshape(-1)
        values = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED]
        sample = values.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample)
    return digest.hexdigest()[:16]


def adapted_modules(adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """The modules an adapter's tensors belong to (`M` of `M.lora_A.weight`), in order."""
    modules = []
    for name in adapter:
        module, _, rest = name.partition(".lora_")
        if rest not in ("A.weight", "B.weight"):
            raise ModelError(f"bad adapter: {name!r} is not a LoRA tensor (M.lora_A.weight, ...)")
        if module not in modules:
            modules.append(module)
    return modules


def merged(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """`M.weight` = base + scaling * B @ A for every module `M` of `adapter`, computed in float32
    and returned in the base's dtype; a ModelError ("bad adapter: ...") for a module the base
    lacks, a missing half, shapes that do not fit, or a value that is not finite."""
    out = {}
    for module in adapted_modules(adapter):
        name = f"{module}.weight"
        weight = base.get(name)
        a, b = adapter.get(f"{module}.lora_A.weight"), adapter.get(f"{module}.lora_B.weight")
        if weight is None:
            raise ModelError(f"bad adapter: the model has no parameter {name!r}")
        if a is None or b is None:
            raise ModelError(f"bad adapter: {module} has only one of lora_A and lora_B")
        rows, cols = tuple(weight.shape)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape != (rows, a.shape[0]):
            raise ModelError(
                f"bad adapter: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, which do not fit its weight {(rows, cols)}"
            )
        device = weight.device
        delta = b.to(device, torch.float32) @ a.to(device, torch.float32)
        if not bool(torch.isfinite(delta).all()):
            raise ModelError(f"bad adapter: {module} holds a NaN or an infinity")
        out[name] = (weight.float() + scaling * delta).to(weight.dtype)
    return out


def metadata(body: bytes | bytearray) -> dict[str, str]:
    """The `__metadata__` of safetensors bytes (empty when it has none or is unreadable)."""
    try:
        (length,) = struct.unpack("<Q", body[:8])
        header = json.loads(body[8 : 8 + length])
    except (struct.error, ValueError):
        return {}
    found = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(found) if isinstance(found, dict) else {}


class AdapterBase:
    """A server's base weights for the adapters pushed to it: each module's weight as it was
    before its first adapter (copied then), and the fingerprint of the whole base. A push of
    full weights or a reload replaces the base (`forget`)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.print = ""

    def merge(
        self,
        current: Mapping[str, torch.Tensor],
        adapter: Mapping[str, torch.Tensor],
        meta: dict[str, str],
    ) -> dict[str, torch.Tensor]:
        """The weights `adapter` (pushed with `meta`: its scaling and its base's fingerprint)
        gives the modules it adapts, merged into the base; `current`: the model's weights now."""
        try:
            scaling, wanted = float(meta[SCALING]), str(meta[BASE])
        except (KeyError, ValueError):
            raise ModelError(f"bad adapter: its metadata lacks {SCALING} or {BASE}") from None
        if not self.print:
            self.print = fingerprint(current)
        if wanted != self.print:
            raise ModelError(
                f"bad adapter: trained on the base model {wanted}, and this server's base is "
                f"{self.print}: start it with the model the trainer adapts (trainer.model)"
            )
        for module in adapted_modules(adapter):  # not adapted before: it still holds the base
            name = f"{module}.weight"
            if name not in self.weights and name in current:
                self.weights[name] = current[name].detach().clone()
        return merged(self.weights, adapter, scaling)

    def forget(self) -> None:
        self.weights, self.print = {}, ""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a LoRA policy (peft's adapter files, no model of its own)."""
    where = Path(path).expanduser()
    return (where / ADAPTER_CONFIG).is_file() and not (where / "config.json").is_file()


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA policy's adapter tensors (named `M.lora_A.weight`, ...) and what it records:
    `base` (the base model's path or hub name), `fingerprint`, `scaling`."""
    from safetensors.torch import load_file

    where = Path(path).expanduser()
    try:
        config = json.loads((where / ADAPTER_CONFIG).read_text())
        record = json.loads((where / BASE_RECORD).read_text())
        tensors = load_file(str(where / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as err:
        raise ModelError(f"LoRA policy {str(path)!r}: cannot read it ({err})") from None
    if config.get("use_rslora"):
        scaling = config["lora_alpha"] / config["r"] ** 0.5
    else:
        scaling = config["lora_alpha"] / config["r"]
    adapter = {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
    adapter = {name.replace(".default.weight", ".weight"): t for name, t in adapter.items()}
    return adapter, {
        "base": config.get("base_model_name_or_path") or record.get("base", ""),
        "fingerprint": record.get("fingerprint", ""),
        "scaling": float(scaling),
    }


def merge_into(model: Any, path: str | Path) -> None:
    """Merge the LoRA policy in `path` into `model`, its base (checked by fingerprint)."""
    adapter, record = read_adapter(path)
    state = model.state_dict()
    found = fingerprint(state)
    if record["fingerprint"] and found != record["fingerprint"]:
        raise ModelError(
            f"LoRA policy {str(path)!r}: its base model {record['base']!r} has changed since "
            f"the adapter was trained (fingerprint {found}, the adapter's "
            f"{record['fingerprint']})"
        )
    with torch.no_grad():
        for name, weight in merged(state, adapter, record["scaling"]).items():
            state[name].copy_(weight)


def adapted_layers(model: Any) -> dict[str, Any]:
    """The adapted layers of `model`, by module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {})
    }


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters: `M.lora_A.weight` (rank, in) and `M.lora_B.weight` (out, rank) of every
    adapted module `M`, named as in the plain model."""
    state = {}
    for name, layer in adapted_layers(model).items():
        state[f"{name}.lora_A.weight"] = layer.lora_A[ADAPTER].weight.detach()
        state[f"{name}.lora_B.weight"] = layer.lora_B[ADAPTER].weight.detach()
    return state


def write_policy(directory: str | Path, model: Any, fmt: Any) -> None:
    """A LoRA policy into `directory`: peft's adapter files, the base's path and fingerprint,
    the tokenizer and the prompt format (see the module docstring)."""
    from safetensors.torch import save_file

    found = getattr(model, "_codeloop_lora", None)
    assert found is not None, "write_policy needs a model with adapters"
    where = Path(directory)
    where.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k: v.contiguous().cpu() for k, v in adapter_state(model).items()}
    save_file(tensors, str(where / ADAPTER_WEIGHTS))
    found.config.save_pretrained(str(where))
    record = {"base": found.base, "fingerprint": found.fingerprint}
    (where / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    fmt.save_pretrained(where)
