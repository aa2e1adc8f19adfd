"""`codeloop demo`: the rStar2-Agent recipe in miniature, end to end on a CPU.

1. Data: synthetic integer arithmetic where the Python tool helps (`data/synthetic.py`);
   train and held-out problems are disjoint by construction.
2. A tokenizer trained here (digits one by one; the fixed JSON head of a tool call is one
   token), the demo's compact chat template, and a tiny Llama-style model from a config.
3. Stage 0: non-reasoning SFT in two phases: clean demonstrations until the policy reproduces
   held-out ones exactly (the copies into the code and into the answer are learned suddenly,
   at a step that varies by seed), then a mix with imperfect ones (a code error then its fix,
   an answer guessed without the tool), so the policy learns the format, not the task.
4. Stages 1-3: the recipe in `demo.toml` beside this file (GRPO-RoC with the real sandbox,
   verifier and trainer; stage 3 refilters to the problems the policy still fails and resets
   the optimiser).
5. After SFT and after each stage: held-out pass@1, mean response length and the tool-error
   ratio among correct trajectories; a PNG of those curves and `summary.json` in the run dir.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from codeloop.config import SandboxConfig, SFTConfig, load_config
from codeloop.data.synthetic import Split, demonstration, problems, tasks
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.model import tiny_model
from codeloop.files import write_atomic
from codeloop.recipe.plot import plot
from codeloop.recipe.points import first_vs_last, score_point, score_text
from codeloop.recipe.runner import run_recipe
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.batch import Sample, collate, on_device
from codeloop.trainer.distributed import one_process
from codeloop.trainer.logs import RunLogger, TensorBoardSink, read_metrics
from codeloop.trainer.rollout_side import local_engine
from codeloop.trainer.sft import encode_conversation, train_sft

DEMO_CONFIG = Path(__file__).with_name("demo.toml")  # package data: a wheel has it too
TEMPLATE = Path(__file__).with_name("demo_chat_template.jinja")
SYSTEM = "Compute with Python."
CALL_HEAD = '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "'


SIZED_FOR = "4-9"  # minutes on two idle x86 cores, measured (docs/benchmarks.md): the SFT's
# length varies with the step at which the copy is learned; other work on the cores adds to it


@dataclass(frozen=True)
class Sizes:
    """How much of everything; the defaults fit the 15-minute budget on 2 CPU cores."""

    sft_clean_steps: int = 600  # clean demonstrations first, until the format is mastered
    sft_mastery: float = 0.95  # ... = this share of held-out demonstrations predicted exactly
    # The copy (expression into code, output into the answer) is learned suddenly, at a step
    # that float rounding moves by hundreds: past sft_clean_steps the clean phase goes on while
    # fewer than sft_copy_share are exact, up to sft_clean_max_steps.
    sft_copy_share: float = 0.25
    sft_clean_max_steps: int = 1500
    sft_check_every: int = 25
    sft_mixed_steps: int = 100  # then the imperfect mix: the format, not the task
    sft_batch: int = 64
    sft_lr: float = 3e-3
    no_tool_share: float = 0.4  # of the mixed demonstrations: answers guessed without the tool
    error_share: float = 0.2  # of the mixed demonstrations: a code error, then the fix
    heldout_per_difficulty: int = 30
    rl_per_difficulty: int = 400
    eval_samples: int = 4


def build_format(seed: int) -> PromptFormat:
    rng = random.Random(seed)
    corpus = []
    for difficulty in (1, 2, 3):
        stream = tasks(seed, "train", difficulty)
        corpus += [f"{task.text} {task.code}" for task in (next(stream) for _ in range(300))]
    corpus += [
        SYSTEM,
        "<reason>Compute it.</reason> Fix the code. I estimate it.",
        "SyntaxError: '(' was never closed",
        "system user assistant",
    ] * 20
    rng.shuffle(corpus)
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    tokenizer.add_tokens([CALL_HEAD, '"}}'])
    return demo_format(tokenizer, TEMPLATE)


def demo_format(tokenizer: Any, template: Path) -> PromptFormat:
    """The demo's prompt: its template, system prompt, and the problem as the user's turn."""
    return PromptFormat(
        tokenizer, str(template), system_prompt=SYSTEM, user_instruction="{problem}"
    )


def sft_conversations(
    fmt: PromptFormat,
    seed: int,
    count: int,
    error_share: float,
    *,
    no_tool_share: float,
    skip: int = 0,
    split: Split = "train",
) -> list[list[dict[str, str]]]:
    """`count` demonstrations, a third per difficulty, after the first `skip` tasks of each."""
    rng = random.Random(seed * 7919 + skip)
    conversations = []
    for difficulty in (1, 2, 3):
        chosen = itertools.islice(tasks(seed, split, difficulty), skip, skip + count // 3)
        conversations += [
            fmt.messages(task.text) + demonstration(task, rng, error_share, no_tool_share)
            for task in chosen
        ]
    rng.shuffle(conversations)
    return conversations


@torch.no_grad()
def exact_share(model: Any, samples: list[Sample], pad_id: int) -> float:
    """Share of `samples` whose every trained token is the model's top prediction."""
    was_training = model.training
    model.eval()
    batch = on_device(collate(samples, pad_id), model)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    right = logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]
    exact = (right | ~batch["loss_mask"].bool()).all(-1)
    model.train(was_training)
    return float(exact.float().mean())


async def run_demo(
    run_dir: Path,
    sizes: Sizes = Sizes(),
    overrides: list[str] | None = None,
    config_path: Path = DEMO_CONFIG,
) -> dict[str, Any]:
    """The whole demo; returns (and writes) the summary. Its one seed is the config's
    `trainer.seed` (`overrides` may set it): the tokenizer, the problems, the SFT policy's
    initial weights and data, and RL all follow from it."""
    start = time.perf_counter()
    cfg = load_config(
        str(config_path), [f"--trainer.output_dir={run_dir / 'rl'}", *(overrides or [])]
    )
    seed = cfg.trainer.seed
    torch.manual_seed(seed)
    held_out = problems(seed, "heldout", dict.fromkeys((1, 2, 3), sizes.heldout_per_difficulty))
    train = problems(seed, "train", dict.fromkeys((1, 2, 3), sizes.rl_per_difficulty))
    points: list[dict[str, Any]] = []
    async with LocalSandbox(SandboxConfig(workers=cfg.sandbox.workers)) as tools:
        model, fmt = stage0(run_dir, seed, sizes)
        world = one_process(cfg.trainer.dtype)
        engine = local_engine(cfg, model, fmt, world)  # the run's one: evaluations and stages

        async def measure(stage: str) -> None:
            metrics = await score_point(
                engine,
                fmt,
                held_out,
                tools,
                rollout=cfg.rollout,
                reward=cfg.reward,
                samples=sizes.eval_samples,
                seed=seed,
            )
            points.append({"stage": stage, **metrics})
            _print_point(points[-1])

        await measure("sft")
        await run_recipe(
            cfg, model, fmt, train, tools=tools, world=world, engine=engine, after_stage=measure
        )
    summary = {
        "seed": seed,
        "resample": cfg.algo.resample,
        "points": points,
        "minutes": (time.perf_counter() - start) / 60,
    }
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    plot(points, run_dir / "curves.png")
    return summary


def stage0(run_dir: Path, seed: int, sizes: Sizes) -> tuple[Any, PromptFormat]:
    """The SFT policy and its prompt format (both loaded when this run directory already has
    them: the policy carries its tokenizer)."""
    saved = run_dir / "sft" / "model"
    if (saved / "config.json").is_file():
        policy = Policy.load(saved)
        return policy.model, policy.fmt
    fmt = build_format(seed)
    model = tiny_model(
        len(fmt.tokenizer), hidden_size=128, layers=2, heads=4, max_positions=1024, seed=seed
    )
    # Held-out demonstrations past the problems `run_demo` evaluates on (the same stream).
    check = [
        encode_conversation(fmt, c)
        for c in sft_conversations(
            fmt,
            seed,
            60,
            0.0,
            no_tool_share=0.0,
            skip=sizes.heldout_per_difficulty,
            split="heldout",
        )
    ]
    logger = RunLogger(run_dir / "sft", [TensorBoardSink(run_dir / "sft")])

    def mastered(steps: int) -> bool:
        if steps % sizes.sft_check_every:
            return False
        share = exact_share(model, check, fmt.tokenizer.pad_token_id or 0)
        logger.log(steps, {"sft/heldout_exact": share})
        tqdm.write(f"sft step {steps}: {100 * share:.0f}% of held-out demonstrations exact")
        learned = steps >= sizes.sft_clean_steps and share >= sizes.sft_copy_share
        return share >= sizes.sft_mastery or learned

    clean = sizes.sft_clean_steps * sizes.sft_batch  # the mixed phase's tasks come after these
    phases = [
        (sizes.sft_clean_max_steps * sizes.sft_batch, 0.0, 0.0, 0, mastered),
        (
            sizes.sft_mixed_steps * sizes.sft_batch,
            sizes.error_share,
            sizes.no_tool_share,
            clean // 3,
            None,
        ),
    ]
    cfg = SFTConfig(
        epochs=1,
        lr=sizes.sft_lr,
        min_lr_ratio=1.0,
        warmup_steps=10,
        conversations_per_step=sizes.sft_batch,
    )
    try:
        done = 0
        for count, error_share, no_tool_share, skip, stop_when in phases:
            conversations = sft_conversations(
                fmt, seed, count, error_share, no_tool_share=no_tool_share, skip=skip
            )
            done += len(
                train_sft(
                    model,
                    fmt,
                    conversations,
                    cfg,
                    logger=logger,
                    seed=seed,
                    first_step=done,
                    stop_when=stop_when,
                )
            )
    finally:
        logger.close()
    Policy(model, fmt).save(saved)
    return model, fmt


def _print_point(point: dict[str, Any]) -> None:
    errors = 100 * point["tool_error_ratio_correct"]
    print(
        f"[{point['stage']}] held-out pass@1 {score_text(point)}, "
        f"response {point['response_tokens']:.0f} tokens, "
        f"tool errors among correct {errors:.1f}%",
        flush=True,
    )


VARIANTS = {
    "grpo": ["--algo.resample=none", "--algo.oversample=1"],  # G sampled, all kept
    "grpo_2g_random": ["--algo.resample=random"],  # 2G sampled, a uniformly random G kept
    "grpo_roc": [],  # 2G sampled, G kept by Resample-on-Correct
}


async def run_ablation(
    run_dir: Path, seeds: list[int], sizes: Sizes = Sizes(), overrides: list[str] | None = None
) -> dict[str, Any]:
    """Plain GRPO (G samples, no resampling), GRPO on a random G of 2G samples, and GRPO-RoC
    (2G -> G) from one SFT policy, with the same steps, prompts and seeds; returns the final
    metrics of each run. The middle arm separates RoC's selection from its extra samples."""
    shared = run_dir / "sft"
    if not (shared / "model" / "config.json").is_file():
        stage0(run_dir, _seed(overrides), sizes)
    results: dict[str, Any] = {}
    for variant, extra in VARIANTS.items():
        for seed in seeds:
            target = run_dir / "ablation" / f"{variant}-seed{seed}"
            if not (target / "sft").exists():
                shutil.copytree(shared, target / "sft")
            summary = await run_demo(
                target, sizes, [*(overrides or []), *extra, f"--trainer.seed={seed}"]
            )
            results[f"{variant}-seed{seed}"] = summary["points"][-1]
    write_atomic(run_dir / "ablation" / "summary.json", json.dumps(results, indent=2))
    _print_ablation(results, seeds)
    return results


def _print_ablation(results: dict[str, Any], seeds: list[int]) -> None:
    print(
        f"\n{'variant':15} {'pass@1':>9} {'response tokens':>16} {'policy tokens':>14} "
        f"{'tool errors | correct':>22}"
    )
    keys = ("pass@1", "response_tokens", "policy_tokens", "tool_error_ratio_correct")
    for variant in VARIANTS:
        rows = [results[f"{variant}-seed{s}"] for s in seeds]
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
        errors = 100 * mean["tool_error_ratio_correct"]
        print(
            f"{variant:15} {100 * mean['pass@1']:>8.1f}% {mean['response_tokens']:>16.1f} "
            f"{mean['policy_tokens']:>14.1f} {errors:>21.1f}%  (seeds {seeds})"
        )


MODES = {"sync": [], "async": ["--trainer.mode=async"]}


async def run_modes(
    run_dir: Path, sizes: Sizes = Sizes(), overrides: list[str] | None = None
) -> dict[str, Any]:
    """The demo's RL synchronous and asynchronous (`trainer.mode`) from one SFT policy, with the
    same seed and stages: after each stage the held-out point, the tokens trained so far and the
    seconds the RL steps took (evaluation and refiltering left out); returns them per mode."""
    shared = run_dir / "sft"
    if not (shared / "model" / "config.json").is_file():
        stage0(run_dir, _seed(overrides), sizes)
    results: dict[str, Any] = {}
    for mode, extra in MODES.items():
        target = run_dir / "modes" / mode
        if not (target / "sft").exists():
            shutil.copytree(shared, target / "sft")
        summary = await run_demo(target, sizes, [*(overrides or []), *extra])
        tokens = seconds = 0.0
        for point in summary["points"][1:]:  # stage i's metrics live in rl/<i>-<name>/
            [stage_dir] = (target / "rl").glob(f"*-{point['stage']}")
            rows = read_metrics(stage_dir)
            tokens += sum(r["loss/policy_tokens"] for r in rows)
            seconds += sum(r["timing/step_s"] for r in rows)
            point |= {"trained_tokens": tokens, "rl_seconds": seconds}
        results[mode] = summary
    write_atomic(run_dir / "modes" / "summary.json", json.dumps(results, indent=2))
    _print_modes(results)
    _plot_modes(results, run_dir / "modes" / "curves.png")
    return results


def _print_modes(results: dict[str, Any]) -> None:
    base = 0.0
    print(
        f"\n{'mode':6} {'RL s':>7} {'trained tokens':>15} {'tokens/s':>9} {'vs sync':>8}  "
        "held-out pass@1 after SFT, then each stage (trained tokens)"
    )
    for mode, summary in results.items():
        last = summary["points"][-1]
        rate = last["trained_tokens"] / max(last["rl_seconds"], 1e-9)
        base = base or rate
        curve = ", ".join(
            f"{100 * p['pass@1']:.1f}%" + (f" ({p['trained_tokens']:.0f})" if i else "")
            for i, p in enumerate(summary["points"])
        )
        print(
            f"{mode:6} {last['rl_seconds']:>7.0f} {last['trained_tokens']:>15.0f} "
            f"{rate:>9.1f} {rate / base if base else 0.0:>7.2f}x  {curve}"
        )


def _plot_modes(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for mode, summary in results.items():
        points = summary["points"]
        tokens = [p.get("trained_tokens", 0.0) for p in points]
        seconds = [p.get("rl_seconds", 0.0) for p in points]
        accuracy = [p["pass@1"] for p in points]
        axes[0].plot(tokens, accuracy, marker="o", label=mode)
        axes[1].plot(seconds, accuracy, marker="o", label=mode)
    axes[0].set_xlabel("trained tokens")
    axes[1].set_xlabel("seconds of RL steps")
    for ax in axes:
        ax.set_ylabel("held-out pass@1")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _seed(overrides: list[str] | None) -> int:
    """The seed the demo's config says with these overrides (`trainer.seed`)."""
    return load_config(str(DEMO_CONFIG), overrides or []).trainer.seed


def main(run_dir: str, overrides: list[str]) -> int:
    summary = asyncio.run(run_demo(Path(run_dir), overrides=overrides))
    first, last = summary["points"][0], summary["points"][-1]
    print(
        f"\ndemo: {summary['minutes']:.1f} min (sized for {SIZED_FOR} min on two idle cores); "
        f"held-out pass@1 {score_text(first)} after "
        f"SFT -> {score_text(last)} after RL; plot {run_dir}/curves.png"
    )
    print(first_vs_last(summary["points"], "held-out pass@1"))
    return 0
