"""`codeloop bench trl`: the same GRPO steps through TRL's `GRPOTrainer` and codeloop's RL, in
one run on one machine.

Every arm: the same policy (`--model`, default SmolLM2-135M-Instruct), the same problems (the
first `--prompts` x `--steps` of `--data`, in order), `--group` samples per prompt, the same
response budget, temperature, learning rate (constant, no warm-up) and loss (TRL's `dapo` =
codeloop's token mean, clip 0.2/0.28, no KL, group-scaled advantages with std epsilon 1e-4),
and the same reward: codeloop's verifier on the answer (with `--last-number`, the last number of
a response without an `<answer>` block counts: `reward.fallback_last_number`, for a policy that
never learned the answer format), in the same dtype (`--dtype`: TRL's `bf16`, codeloop's
`trainer.dtype`; float32 by default). Arms: TRL single-turn (as its users run
it on a CPU: transformers' `generate`), codeloop single-turn (`rollout.tools = []`,
`rollout.max_turns = 1`: a tool call is not answered), and codeloop with the Python tool. Each
arm runs in its own process, so its peak memory is its own.

codeloop runs TRL's plain GRPO: no Resample-on-Correct (`algo.oversample 1`,
`algo.resample none`), groups without signal kept rather than refilled; it skips the update of
a step whose groups all lack signal, where TRL still runs it (the table shows the step's update
time either way). Per step: wall time split into sampling with scoring, and the update (with
codeloop's weight sync); sampled tokens/s; then the mean reward over the run with its interval,
peak memory, and the ratios TRL/codeloop of step time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from codeloop.config import Config, RewardConfig
from codeloop.data.pretrained import smollm2
from codeloop.data.problems import GSM8K_TRAIN, Problem, load_problems
from codeloop.helpformat import HelpFormatter, positive_count
from codeloop.intervals import interval, percent

ARMS = ("trl", "codeloop", "codeloop+tool")
TRL_STD_EPS = 1e-4  # fixed inside TRL's advantage computation


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="codeloop bench trl", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--model", default="", help="policy directory (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--data", default="", help="problems, in codeloop's formats (default: GSM8K's, packaged)"
    )
    p.add_argument("--steps", type=positive_count, default=3, help="RL steps per arm")
    p.add_argument("--prompts", type=positive_count, default=4, help="prompts per step")
    p.add_argument("--group", type=positive_count, default=4, help="samples per prompt (G)")
    p.add_argument(
        "--max-tokens", type=positive_count, default=256, help="response budget per sample"
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="every arm's compute dtype: TRL's bf16, codeloop's trainer.dtype",
    )
    p.add_argument(
        "--last-number",
        action="store_true",
        help="score the last number of a response without an <answer> block, in every arm "
        "(reward.fallback_last_number)",
    )
    p.add_argument("--arms", default=",".join(ARMS), help=f"which of {','.join(ARMS)}")
    p.add_argument("--out", default="runs/bench_trl", help="folder for the arms' runs and report")
    p.add_argument("--arm", default="", help=argparse.SUPPRESS)  # one arm, in its own process
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        steps = _trl_arm(args, out) if args.arm == "trl" else _codeloop_arm(args, out)
        peak_kib = max(  # codeloop's arm runs `codeloop train` as a child
            resource.getrusage(who).ru_maxrss
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        peak_mib = peak_kib / 1024
        (out / f"{args.arm}.json").write_text(json.dumps({"steps": steps, "peak_mib": peak_mib}))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        print(f"codeloop bench trl: unknown arms {sorted(unknown)} (valid: {', '.join(ARMS)})")
        return 2
    args.model = args.model or str(smollm2())
    settings = {k: v for k, v in vars(args).items() if k not in ("arm", "arms")}
    forwarded: list[str] = []
    for key, value in settings.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True or value is False:  # --last-number: given or left off
            forwarded += [flag] if value else []
        else:
            forwarded += [flag, str(value)]
    for arm in arms:
        print(f"arm {arm} ...", flush=True)
        command = [sys.executable, "-m", "codeloop.bench.trl", *forwarded, "--arm", arm]
        done = subprocess.run(command, check=False)
        if done.returncode:
            print(f"codeloop bench trl: the {arm} arm failed (exit {done.returncode})")
            return 1
    results = {arm: json.loads((out / f"{arm}.json").read_text()) for arm in arms}
    report = _report(results, args)
    (out / "report.md").write_text(report)
    print(report)
    return 0


def _problems(args: argparse.Namespace) -> list[Problem]:
    cfg = Config().data
    cfg.integer_answers_only = False
    problems = load_problems(args.data or str(GSM8K_TRAIN), cfg)[: args.prompts * args.steps]
    if len(problems) < args.prompts * args.steps:
        raise SystemExit(f"{args.data}: {len(problems)} problems, fewer than prompts x steps")
    return problems


def _codeloop_config(args: argparse.Namespace, out: Path, tool: bool) -> Path:
    """The arm's run config (TOML), its problems beside it."""
    data = out / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
            for p in _problems(args)
        )
    )
    run_dir = out / ("codeloop_tool" if tool else "codeloop")
    tools, turns = ('["python"]', 30) if tool else ("[]", 1)  # single-turn: one model turn
    text = f"""
[trainer]
model = "{args.model}"
output_dir = "{run_dir}"
seed = {args.seed}
prompts_per_step = {args.prompts}
max_steps = {args.steps}
lr = {args.lr}
warmup_steps = 0
dtype = "{args.dtype}"
checkpoint_every = 0
loggers = []

[algo]
group_size = {args.group}
oversample = 1
resample = "none"
drop_zero_signal_groups = false
adv_eps = {TRL_STD_EPS}

[rollout]
max_response_tokens = {args.max_tokens}
temperature = {args.temperature}
tools = {tools}
max_turns = {turns}

[reward]
fallback_last_number = {str(args.last_number).lower()}

[data]
train = "{data}"
integer_answers_only = false
id_field = "id"
"""
    path = out / f"{run_dir.name}.toml"
    path.write_text(text)
    return path


def _codeloop_arm(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    config = _codeloop_config(args, out, tool=args.arm == "codeloop+tool")
    run_dir = out / ("codeloop_tool" if args.arm == "codeloop+tool" else "codeloop")
    subprocess.run([sys.executable, "-m", "codeloop", "train", "--config", str(config)], check=True)
    steps = []
    for row in (json.loads(line) for line in (run_dir / "metrics.jsonl").open()):
        dump = run_dir / "trajectories" / f"step_{row['step']:06d}.jsonl"
        samples = [json.loads(line) for line in dump.open()]
        rewards = [sample["reward"] or 0.0 for sample in samples]
        groups: dict[str, list[float]] = {}  # by prompt
        for sample, r in zip(samples, rewards, strict=True):
            groups.setdefault(sample["prompt_id"], []).append(r)
        steps.append(
            {
                "sample_s": row["timing/rollout_and_reward_s"],
                "update_s": row["timing/update_s"] + row["timing/sync_s"],
                "step_s": row["timing/step_s"],
                "tokens": row["rollout/policy_tokens"] * len(rewards),
                "rewards": rewards,
                "signal_groups": with_signal(groups.values()),
            }
        )
    return steps


def _trl_arm(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    import datasets  # the dev extra (with trl)
    from transformers import PrinterCallback, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from codeloop.reward.verifier import Verifier
    from codeloop.rollout.policy import Policy

    warnings.simplefilter("ignore", FutureWarning)  # transformers' renamed arguments, in TRL
    cfg = Config()
    cfg.rollout.tools = []
    policy = Policy.load(args.model, cfg)
    problems = _problems(args)
    prompts = [policy.fmt.render(policy.fmt.messages(p.problem), True) for p in problems]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "gold": [p.answer for p in problems]})
    verifier = Verifier(RewardConfig(fallback_last_number=args.last_number))
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    def reward(completions: list[str], gold: list[str], **_: Any) -> list[float | None]:
        start = time.perf_counter()
        scored: list[float | None] = [
            r.reward for r in verifier.score_batch(list(zip(completions, gold, strict=True)))
        ]
        current["score_s"] = current.get("score_s", 0.0) + time.perf_counter() - start
        current["rewards"] = scored
        return scored

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.grad_clip,
        beta=0.0,
        epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=args.steps,
        shuffle_dataset=False,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        log_level="error",
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
    )
    trainer = GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=policy.fmt.tokenizer,
    )
    generate = trainer._generate

    def timed_generate(batch: list[Any]) -> Any:
        start = time.perf_counter()
        result = generate(batch)
        current["generate_s"] = time.perf_counter() - start
        current["tokens"] = sum(len(ids) for ids in result[1])  # the completions' token ids
        return result

    trainer._generate = timed_generate  # type: ignore[method-assign,assignment]

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            current.clear()
            current["start"] = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_s = time.perf_counter() - current["start"]
            sample_s = current["generate_s"] + current.get("score_s", 0.0)
            steps.append(
                {
                    "sample_s": sample_s,
                    "update_s": step_s - sample_s,
                    "step_s": step_s,
                    "tokens": current["tokens"],
                    "rewards": current["rewards"],
                    "signal_groups": with_signal(_consecutive(current["rewards"], args.group)),
                }
            )

    trainer.add_callback(Clock())
    trainer.remove_callback(PrinterCallback)  # a dict of metrics per step: the report has them
    trainer.train()
    verifier.close()
    return steps


def with_signal(groups: Iterable[Sequence[float | None]]) -> int:
    """The groups whose rewards are not all equal (None scores 0): those a GRPO update learns
    from."""
    return sum(len({r or 0.0 for r in group}) > 1 for group in groups)


def _consecutive(rewards: list[float | None], group: int) -> list[list[float | None]]:
    """Runs of `group` rewards, as TRL lays out the generations of a prompt."""
    return [rewards[i : i + group] for i in range(0, len(rewards), group)]


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"codeloop bench trl: {Path(args.model).name}, {args.steps} steps x {args.prompts} "
        f"prompts x G {args.group}, {args.max_tokens} tokens, temperature {args.temperature}, "
        f"{args.dtype}"
        + (", the last number scored without an <answer>" if args.last_number else ""),
        "",
        "| arm | step s | sampling+scoring s | update s | sampled tokens/s | reward "
        "| groups with signal | peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, result in results.items():
        steps = result["steps"]
        n = len(steps)
        rewards = [r for s in steps for r in s["rewards"]]
        mean = sum(rewards) / max(len(rewards), 1)
        tokens_per_s = sum(s["tokens"] for s in steps) / sum(s["sample_s"] for s in steps)
        lines.append(
            f"| {arm} | {sum(s['step_s'] for s in steps) / n:.1f} | "
            f"{sum(s['sample_s'] for s in steps) / n:.1f} | "
            f"{sum(s['update_s'] for s in steps) / n:.1f} | {tokens_per_s:.0f} | "
            f"{percent(mean, interval(rewards))} | "
            f"{sum(s.get('signal_groups', 0) for s in steps)} of {n * args.prompts} | "
            f"{result['peak_mib']:.0f} |"
        )
    if "trl" in results:
        base = results["trl"]["steps"]
        for arm in (a for a in results if a != "trl"):
            ours = results[arm]["steps"]
            ratios = {
                key: sum(s[key] for s in base) / max(sum(s[key] for s in ours), 1e-9)
                for key in ("step_s", "sample_s", "update_s")
            }
            lines.append(
                f"\nTRL / {arm}: step {ratios['step_s']:.2f}x, sampling+scoring "
                f"{ratios['sample_s']:.2f}x, update {ratios['update_s']:.2f}x"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
