import asyncio
import copy
import json
import math
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from trainer_helpers import PAIRS

from codeloop.algo.group import make_group
from codeloop.config import AlgoConfig, Config, SandboxConfig
from codeloop.data.problems import Problem
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.logs import RunLogger, read_metrics
from codeloop.trainer.rl import RLRun, build_run
from codeloop.types import (
    ExecResult,
    ExecStatus,
    RolloutStatus,
    ToolCall,
    ToolCallRecord,
    Trajectory,
)

PROBLEMS = [Problem(f"p{i}", f"What is {a} + {b}?", str(a + b)) for i, (a, b) in enumerate(PAIRS)]


def _config(run_dir: Path) -> Config:
    cfg = Config()
    cfg.trainer.output_dir = str(run_dir)
    cfg.trainer.prompts_per_step, cfg.trainer.lr, cfg.trainer.warmup_steps = 2, 1e-3, 0
    cfg.trainer.checkpoint_every, cfg.trainer.micro_batch_tokens = 1, 4096
    cfg.algo.group_size, cfg.algo.oversample = 2, 2
    cfg.rollout.max_response_tokens, cfg.rollout.max_turns = 200, 3
    cfg.rollout.temperature = 0.7
    cfg.reward.workers = 1
    return cfg


def _run(
    fmt: PromptFormat,
    weights: dict[str, torch.Tensor],
    run_dir: Path,
    steps: int,
    resume: bool = False,
    lora_rank: int = 0,
) -> tuple[list[dict[str, float]], RLRun]:
    """`steps` RL steps of the policy with `weights` (trainer.lora.rank `lora_rank`), sampled by
    a deterministic in-process engine."""

    async def main() -> tuple[list[dict[str, float]], RLRun]:
        model = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
        model.load_state_dict(weights)
        engine = TransformersEngine(
            copy.deepcopy(model), fmt.tokenizer, fmt.end_of_turn_ids, max_batch=1, batch_window_ms=0
        )  # deterministic
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(run_dir)
            cfg = _config(run_dir)
            cfg.trainer.lora.rank = lora_rank
            run = build_run(cfg, model, fmt, PROBLEMS, tools=sandbox, logger=logger, engine=engine)
            if resume:
                assert run.resume()
            metrics = await run.train(steps)
            logger.close()
            run.rollout.verifier.close()
            return metrics, run

    return asyncio.run(main())


@pytest.mark.slow
def test_two_rl_steps_end_to_end(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    metrics, run = _run(trainer_fmt, sft_weights, tmp_path, 2)
    changed = [
        k for k, v in run.learner.model.state_dict().items() if not torch.equal(v, sft_weights[k])
    ]
    assert len(changed) == len(sft_weights)  # every parameter moved
    m = metrics[0]
    assert 0 < m["reward/mean"] < 1, "the SFT policy should be right sometimes, not always"
    assert m["rollout/tool_calls"] > 0 and m["loss/policy_tokens"] > 0 and m["loss/grad_norm"] > 0
    dump = (tmp_path / "trajectories" / "step_000001.jsonl").read_text()
    dumped = [json.loads(line) for line in dump.splitlines()]
    # Groups without signal were dropped and refilled: every sampled group is dumped, 2 of its
    # 4 kept when it trained; 2 trained groups, the dropped ones counted.
    assert m["rollout/groups_kept"] == 2 and sum(d["kept"] for d in dumped) == 2 * 2
    assert len(dumped) == 4 * (2 + m["rollout/groups_dropped"])
    # the engine's own counters: one row at a time, every turn prefilled alone, or fed through
    # the steps (at least a token each; with mixed steps a prompt's chunk may sample nothing)
    turns = sum(d["num_turns"] for d in dumped)
    assert m["engine/steps"] > 0
    if run.rollout.engines[0].step_tokens:
        assert m["engine/prefills"] == 0 and m["engine/mixed_steps"] >= turns
        assert 0 < m["engine/rows_per_step"] <= 1.0 and m["engine/fed_tokens"] >= turns
    else:
        assert m["engine/rows_per_step"] == 1.0 and 0 < m["engine/prefills"] <= turns
        assert m["engine/prefills"] + m["engine/fed_tokens"] >= turns
    for name, value in run.learner.model.state_dict().items():  # the engine got the new weights
        assert torch.equal(value, run.rollout.engines[0].model.state_dict()[name])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    saved = tmp_path / "checkpoints" / "step_000002" / "model"  # weights and tokenizer: loads alone
    vocab = transformers.AutoTokenizer.from_pretrained(saved).get_vocab()
    assert vocab == trainer_fmt.tokenizer.get_vocab()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert loaded.keys() == run.learner.model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in run.learner.model.state_dict().items())


@pytest.mark.slow
def test_a_resumed_run_reproduces_the_uninterrupted_one(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    straight, _ = _run(trainer_fmt, sft_weights, tmp_path / "a", 3)
    _run(trainer_fmt, sft_weights, tmp_path / "b", 1)
    resumed, run = _run(
        trainer_fmt,
        {k: torch.zeros_like(v) for k, v in sft_weights.items()},
        tmp_path / "b",
        2,
        resume=True,
    )
    assert run.step_index == 3
    keys = ["reward/mean", "rollout/response_tokens", "loss/loss", "loss/grad_norm", "loss/lr"]
    for a, b in zip(straight[1:], resumed, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]


def _served_policy(fmt: PromptFormat, weights: Any, root: Path) -> tuple[Any, Path, Config]:
    """The SFT policy, saved where `codeloop serve` can serve it, and a run config."""
    model = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
    model.load_state_dict(weights)
    served = root / "served"
    model.save_pretrained(served)
    fmt.tokenizer.save_pretrained(served)
    return model, served, _config(root / "run")


@pytest.mark.slow
def test_rl_on_two_servers_pushes_the_new_weights_to_both(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path, codeloop_serve: Any
) -> None:
    from codeloop.engine.openai_engine import OpenAIEngine
    from codeloop.engine.protocol import SamplingParams

    fmt = trainer_fmt
    model, served, cfg = _served_policy(fmt, sft_weights, tmp_path)
    cfg.rollout.backend, cfg.rollout.scheduler = "openai", "kv_aware"
    prompt = fmt.prompt_ids(PROBLEMS[0].problem)

    async def main(urls: list[str]) -> tuple[dict[str, float], RLRun, list[Any]]:
        cfg.rollout.endpoints = urls
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(tmp_path / "run")
            run = build_run(cfg, model, fmt, PROBLEMS, tools=sandbox, logger=logger)
            try:
                metrics = (await run.train(1))[0]
                params = SamplingParams(8, temperature=1.0, seed=3)
                generations, versions = [], []
                for url in urls:
                    server = OpenAIEngine(url)
                    generations.append(await server.generate(prompt, params))
                    versions.append(await server.served_version())
                    await server.close()
                assert versions == [1, 1]  # each holds the weights of step 1
            finally:
                logger.close()
                await run.close()
        return metrics, run, generations

    with codeloop_serve(served) as one, codeloop_serve(served) as two:
        metrics, run, generations = asyncio.run(main([one, two]))
    assert metrics["loss/policy_tokens"] > 0 and metrics["rollout/tool_calls"] > 0
    assert not (tmp_path / "run" / "weights").exists()  # the weights went over HTTP
    original = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
    original.load_state_dict(sft_weights)
    for generation in generations:  # both servers score with the trained weights
        ids = torch.tensor([prompt + generation.token_ids])
        with torch.no_grad():
            trained = _chosen_logprobs(run.learner.model, ids, len(prompt))
            before = _chosen_logprobs(original, ids, len(prompt))
        assert generation.logprobs == pytest.approx(trained, abs=1e-5)
        assert max(abs(a - b) for a, b in zip(trained, before, strict=True)) > 2e-4


@pytest.mark.slow
def test_an_rl_step_over_tls(
    trainer_fmt: PromptFormat,
    sft_weights: Any,
    tmp_path: Path,
    codeloop_serve: Any,
    sandbox_serve: Any,
    tls_certificate: tuple[Path, Path],
) -> None:
    """Both servers serve https:// with a self-signed certificate: the run samples, runs its
    tool calls and pushes its weights over TLS, trusting the certificate through its CA-file
    settings."""
    from codeloop.engine.openai_engine import OpenAIEngine
    from codeloop.sandbox.client import SandboxClient

    cert, key = tls_certificate
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    model, served, cfg = _served_policy(trainer_fmt, sft_weights, tmp_path)
    cfg.rollout.backend = "openai"
    cfg.rollout.server_ca_file = str(cert)

    async def main(inference: str, sandbox: str) -> tuple[dict[str, float], int | None]:
        cfg.rollout.endpoints = [inference]
        tools = SandboxClient([sandbox], SandboxConfig(ca_file=str(cert)))
        async with tools:
            logger = RunLogger(tmp_path / "run")
            run = build_run(cfg, model, trainer_fmt, PROBLEMS, tools=tools, logger=logger)
            try:
                metrics = (await run.train(1))[0]
            finally:
                logger.close()
                await run.close()
        server = OpenAIEngine(inference, ca_file=str(cert))
        try:
            return metrics, await server.served_version()
        finally:
            await server.close()

    with codeloop_serve(served, *tls) as inference, sandbox_serve(*tls) as sandbox:
        assert inference.startswith("https://") and sandbox.startswith("https://")
        metrics, version = asyncio.run(main(inference, sandbox))
    assert metrics["loss/policy_tokens"] > 0 and metrics["rollout/tool_calls"] > 0
    assert metrics["rollout/status_error"] == 0.0 and metrics["rollout/infra_faults"] == 0.0
    assert version == 1  # the step's weights reached the server over TLS


@pytest.mark.slow
def test_a_server_that_kept_its_old_weights_stops_the_run(
    trainer_fmt: PromptFormat,
    sft_weights: Any,
    tmp_path: Path,
    codeloop_serve: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from codeloop.engine.openai_engine import EngineError, OpenAIEngine

    fmt = trainer_fmt
    model, served, cfg = _served_policy(fmt, sft_weights, tmp_path)
    cfg.rollout.backend, cfg.rollout.reload_check_tol = "openai", 1e-4  # float32 server: ~1e-6

    from safetensors.torch import save

    push = OpenAIEngine.push_weights

    async def stale_push(self: Any, blob: bytes, version: int) -> None:  # no weights in it
        await push(self, save({}), version)

    async def main(url: str) -> None:
        cfg.rollout.endpoints = [url]
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(tmp_path / "run")
            run = build_run(cfg, model, fmt, PROBLEMS, tools=sandbox, logger=logger)
            try:
                await run.sync_weights()  # the served weights are the trainer's: it passes
                monkeypatch.setattr(OpenAIEngine, "push_weights", stale_push)
                with pytest.raises(EngineError, match="still serves other weights"):
                    await run.train(1)  # trained at lr 1e-3, then not reloaded
            finally:
                logger.close()
                await run.close()

    with codeloop_serve(served) as url:
        asyncio.run(main(url))


def _chosen_logprobs(model: Any, ids: torch.Tensor, start: int) -> list[float]:
    logits = model(input_ids=ids).logits[0, start - 1 : -1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, ids[0, start:, None])
    return [float(v) for v in chosen.squeeze(-1)]


class _KilledAtFirstCall:
    """The sandbox of an RL run: a `SandboxClient` over two real servers, the first of which is
    killed when the step's first tool call arrives, then started again on its port."""

    def __init__(self, client: Any, victim: Any) -> None:
        self.client, self.victim = client, victim
        self.restarted: list[Any] = []
        self.killer: threading.Thread | None = None

    def _kill_and_restart(self) -> None:
        from test_sandbox_server import Server

        self.victim.process.wait()  # killed by `execute`
        time.sleep(0.5)
        self.restarted.append(Server(port=self.victim.port))

    async def execute(self, request: Any) -> Any:
        if self.killer is None:
            self.victim.process.kill()  # dead before this call is sent: it may go there
            self.killer = threading.Thread(target=self._kill_and_restart)
            self.killer.start()
        return await self.client.execute(request)


@pytest.mark.slow
def test_an_rl_step_survives_a_sandbox_server_killed_and_restarted(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "sandbox"))
    from test_sandbox_server import Server

    from codeloop.sandbox.client import SandboxClient

    a, b = Server(), Server()
    sandbox: _KilledAtFirstCall | None = None

    async def main() -> list[dict[str, float]]:
        nonlocal sandbox
        model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
        model.load_state_dict(sft_weights)
        cfg = SandboxConfig(client_flush_ms=1.0, client_retries=6)
        async with SandboxClient([a.url, b.url], cfg) as client:
            sandbox = _KilledAtFirstCall(client, a)
            logger = RunLogger(tmp_path)
            run = build_run(
                _config(tmp_path), model, trainer_fmt, PROBLEMS, tools=sandbox, logger=logger
            )
            first = await run.train(1)
            assert sandbox.killer is not None
            sandbox.killer.join()
            served_before = _served(sandbox.restarted[0])
            second = await run.train(1)  # the restarted server rejoins
            assert _served(sandbox.restarted[0]) > served_before
            logger.close()
            run.rollout.verifier.close()
            return first + second

    try:
        metrics = asyncio.run(main())
    finally:
        for server in [a, b, *(sandbox.restarted if sandbox else [])]:
            server.stop()
    assert len(metrics) == 2 and all(m["rollout/tool_calls"] > 0 for m in metrics)
    for step in (1, 2):  # one result per call, and no infrastructure fault among them
        lines = (tmp_path / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        records = [r for line in lines for r in json.loads(line)["tool_calls"]]
        statuses = {r["result"]["status"] for r in records if r["call"] is not None}
        assert "sandbox_error" not in statuses and "ok" in statuses, statuses


def _served(server: Any) -> int:
    text = server.get("/metrics")[1]
    return sum(int(n) for n in re.findall(r'sandbox_calls_total\{status="\w+"\} (\d+)', text))


class _FaultyEveryOther:
    """A sandbox whose every second call fails through the infrastructure, as a crashed or
    unreachable server does, and whose other calls run for real."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox, self.calls = sandbox, 0

    async def execute(self, request: Any) -> Any:
        self.calls += 1
        if self.calls % 2 == 0:
            return ExecResult(status=ExecStatus.SANDBOX_ERROR, stderr="connection refused")
        return await self.sandbox.execute(request)


def test_trajectories_that_hit_an_infrastructure_fault_are_masked_not_penalised(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    async def main() -> dict[str, float]:
        model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
        model.load_state_dict(sft_weights)
        cfg = _config(tmp_path)
        cfg.algo.drop_zero_signal_groups = False  # every group is dumped with what it kept
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(tmp_path)
            run = build_run(
                cfg, model, trainer_fmt, PROBLEMS, tools=_FaultyEveryOther(sandbox), logger=logger
            )
            (metrics,) = await run.train(1)
            logger.close()
            run.rollout.verifier.close()
            return metrics

    metrics = asyncio.run(main())
    lines = (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    dumped = [json.loads(line) for line in lines]
    statuses = [{r["result"]["status"] for r in t["tool_calls"]} for t in dumped]
    faulted = [t for t, seen in zip(dumped, statuses, strict=True) if "sandbox_error" in seen]
    healthy = [t for t in dumped if t not in faulted]
    assert faulted and healthy  # the policy calls the tool; half its calls fail
    assert not any(t["kept"] for t in faulted)
    assert metrics["rollout/infra_faults"] == pytest.approx(len(faulted) / len(dumped))
    # tool errors are the model's only: the faults are not among them
    calls = [r for t in dumped for r in t["tool_calls"]]
    model_errors = [
        r for r in calls if r["parse_error"] or r["result"]["status"] not in ("ok", "sandbox_error")
    ]
    assert metrics["rollout/tool_error_ratio"] == pytest.approx(len(model_errors) / len(calls))


def _scored(index: int, reward: float, status: str = "ok") -> Any:
    call = ToolCallRecord(ToolCall("python", {"code": "1"}, ""), ExecResult(ExecStatus(status)))
    trajectory = Trajectory("p", index, [1], [2], [1], [-0.5], RolloutStatus.ANSWERED, [call])
    trajectory.reward = reward
    return trajectory


def test_a_group_leaves_out_what_an_infrastructure_fault_touched() -> None:
    algo = AlgoConfig(group_size=2, oversample=2, resample="none")
    # sample 0 was right, but its tool call never ran: the group is samples 1-3 and the first
    # two of them train (plain GRPO keeps the first G): rewards 0 and 1, advantages -/+ 1/std
    sampled = [
        _scored(0, 1.0, "sandbox_error"),
        _scored(1, 0.0),
        _scored(2, 1.0),
        _scored(3, 0.0, "error"),
    ]
    group = make_group(PROBLEMS[0], sampled, algo, random.Random(0))
    assert [t.sample_index for t in group.kept] == [1, 2]
    std = 2**-0.5  # sample standard deviation of (0, 1)
    assert group.advantages == pytest.approx([-0.5 / std, 0.5 / std], rel=1e-5)
    assert group.sampled == sampled
    # every sample hit a fault: nothing to train on
    broken = [_scored(i, 1.0, "sandbox_error") for i in range(4)]
    assert make_group(PROBLEMS[0], broken, algo, random.Random(0)).kept == []
    # an engine or inference server that failed a sample (status error) decided its end too
    failed = _scored(0, 0.0)
    failed.status = RolloutStatus.ERROR
    group = make_group(
        PROBLEMS[0], [failed, *sampled[1:3], _scored(3, 0.0)], algo, random.Random(0)
    )
    assert [t.sample_index for t in group.kept] == [1, 2]


def _update_two(
    cfg: Config,
    fmt: PromptFormat,
    tmp_path: Path,
    ratios_a: tuple[float, float],
    ratios_b: tuple[float, float],
) -> tuple[Any, Any, dict[str, float]]:
    """One `Learner.update` of a tiny model on two samples of two policy tokens each (advantages
    +1 and -1), whose old logprobs are the model's own minus log(ratio) per token; returns the
    samples and the update's metrics."""
    from codeloop.trainer.batch import Sample, collate, token_logprobs

    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2)
    cfg.rollout.temperature, cfg.trainer.updates_per_step = 1.0, 1
    a = Sample([5, 6, 7], [0, 1, 1], [0.0] * 3, advantage=1.0)
    b = Sample([8, 9, 10], [0, 1, 1], [0.0] * 3, advantage=-1.0)
    with torch.no_grad():
        now = token_logprobs(model, collate([a, b], 0))[0]  # [2, 2]
    for sample, row, ratios in ((a, 0, ratios_a), (b, 1, ratios_b)):
        sample.old_logprobs = [0.0] + [
            float(now[row, j]) - math.log(r) for j, r in enumerate(ratios)
        ]
    logger = RunLogger(tmp_path)
    run = build_run(cfg, model, fmt, PROBLEMS, tools=None, logger=logger)  # type: ignore[arg-type]
    metrics = run.learner.update([a, b])
    run.rollout.verifier.close()
    logger.close()
    return a, b, metrics


def test_update_matches_the_clipped_loss_worked_by_hand(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.dual_clip = 0.2, 0.28, 0.0
    # old logprobs set so that the ratios are A: 1.5, 1.0 and B: 0.5, 1.1
    _, _, metrics = _update_two(cfg, trainer_fmt, tmp_path, (1.5, 1.0), (0.5, 1.1))
    # per token -min(r A, clip(r, 0.8, 1.28) A): A1 -1.28 (clipped), A2 -1.0, B1 +0.8
    # (clipped), B2 +1.1; the token mean over the 4 policy tokens
    assert metrics["loss/loss"] == pytest.approx((-1.28 - 1.0 + 0.8 + 1.1) / 4, abs=1e-5)
    assert metrics["loss/clip_fraction"] == pytest.approx(2 / 4)
    k3 = [r - 1 - math.log(r) for r in (1.5, 1.0, 0.5, 1.1)]  # approx KL per token
    assert metrics["loss/approx_kl"] == pytest.approx(sum(k3) / 4, abs=1e-5)
    assert metrics["loss/policy_tokens"] == 4


def test_decoupled_update_weights_tokens_by_proximal_over_behaviour(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    cfg = _config(tmp_path)
    cfg.algo.off_policy, cfg.algo.behaviour_weight_cap = "decoupled", 2.0
    # behaviour (engine) logprobs set so that proximal/behaviour = A: 1.5, 0.5; B: 3.0, 1.0
    a, b, metrics = _update_two(cfg, trainer_fmt, tmp_path, (1.5, 0.5), (3.0, 1.0))
    assert a.weights == pytest.approx([0.0, 1.5, 0.5], abs=1e-5)
    assert b.weights == pytest.approx([0.0, 2.0, 1.0], abs=1e-5)  # 3.0 truncated at the cap
    # the ratio is against the recomputed (proximal) logprobs: 1 before the step, so each token
    # costs -A x its weight: (-1.5 - 0.5 + 2.0 + 1.0) / 4
    assert metrics["loss/loss"] == pytest.approx((-1.5 - 0.5 + 2.0 + 1.0) / 4, abs=1e-5)
    assert metrics["loss/clip_fraction"] == 0.0
