"""LoRA RL (trainer.lora): adapters trained through peft on the frozen policy, merged for the
in-process engine, pushed alone to servers, checkpointed alone and resumed on the same base."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_rl import PROBLEMS, _chosen_logprobs, _run, _served_policy
from transformers import AutoModelForCausalLM

from codeloop.config import ConfigError
from codeloop.engine.model import tiny_model
from codeloop.rollout.policy import Policy
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer import lora
from codeloop.trainer.checkpoint import read_state
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import build_run

RANK, SCALE = 4, 16.0 / 4  # trainer.lora.alpha is 16 by default
ADAPTED = 7 * 2  # q, k, v, o, gate, up, down in each of two layers


@pytest.mark.slow
def test_lora_rl_trains_the_adapters_alone_and_the_engine_samples_the_merged_weights(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    metrics, run = _run(trainer_fmt, sft_weights, tmp_path, 2, lora_rank=RANK)
    model, engine = run.learner.model, run.rollout.engines[0].model  # type: ignore[attr-defined]
    adapters = lora.adapter_state(model)
    assert len(adapters) == 2 * ADAPTED
    trained = [p for group in run.learner.optimizer.param_groups for p in group["params"]]
    assert {p.data_ptr() for p in trained} == {t.data_ptr() for t in adapters.values()}
    base = lora.base_state(model)  # frozen: the SFT weights, exactly
    assert base.keys() == sft_weights.keys()
    assert all(torch.equal(base[k], sft_weights[k]) for k in base)
    assert all(t.abs().sum() > 0 for k, t in adapters.items() if "lora_B" in k)  # B left zero
    assert metrics[-1]["loss/policy_tokens"] > 0
    # The engine samples with base + (alpha / rank) * B @ A, worked out here:
    name = "model.layers.1.mlp.down_proj"
    product = adapters[f"{name}.lora_B.weight"] @ adapters[f"{name}.lora_A.weight"]
    expected = sft_weights[f"{name}.weight"] + SCALE * product
    assert torch.allclose(engine.state_dict()[f"{name}.weight"], expected, atol=1e-6)
    assert not torch.allclose(expected, sft_weights[f"{name}.weight"], atol=1e-6)
    embed = "model.embed_tokens.weight"
    assert torch.equal(engine.state_dict()[embed], sft_weights[embed])
    # ... which computes what the trainer's adapted model computes.
    ids = torch.tensor([trainer_fmt.prompt_ids(PROBLEMS[0].problem)])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, engine(input_ids=ids).logits, atol=1e-4)
    # The checkpoint holds the adapters and their optimiser state, nothing of the base.
    step = tmp_path / "checkpoints" / "step_000002"
    assert not (step / "model" / "model.safetensors").exists()
    saved = load_file(step / "model" / "adapter_model.safetensors")
    assert saved.keys() == {f"base_model.model.{k}" for k in adapters}
    assert len(read_state(step)["optimizer"]["state"]) == 2 * ADAPTED


@pytest.mark.slow
def test_a_resumed_lora_run_reproduces_the_uninterrupted_one_on_its_own_base_only(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path
) -> None:
    straight, _ = _run(trainer_fmt, sft_weights, tmp_path / "a", 3, lora_rank=RANK)
    _run(trainer_fmt, sft_weights, tmp_path / "b", 1, lora_rank=RANK)
    resumed, run = _run(trainer_fmt, sft_weights, tmp_path / "b", 2, True, lora_rank=RANK)
    assert run.step_index == 3
    keys = ["reward/mean", "rollout/response_tokens", "loss/loss", "loss/grad_norm", "loss/lr"]
    for a, b in zip(straight[1:], resumed, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)
    other = {k: v + 0.01 for k, v in sft_weights.items()}
    with pytest.raises(ConfigError, match="trained on another base model"):
        _run(trainer_fmt, other, tmp_path / "b", 1, True, lora_rank=RANK)
    with pytest.raises(ConfigError, match="holds LoRA adapters and this run trains the full"):
        _run(trainer_fmt, sft_weights, tmp_path / "b", 1, True)
    with pytest.raises(ConfigError, match="another trainer.lora.rank"):
        _run(trainer_fmt, sft_weights, tmp_path / "b", 1, True, lora_rank=RANK * 2)


@pytest.mark.slow
def test_lora_rl_on_a_server_pushes_the_adapters_alone_and_the_server_merges_them(
    trainer_fmt: PromptFormat, sft_weights: Any, tmp_path: Path, codeloop_serve: Any
) -> None:
    from codeloop.engine.openai_engine import EngineError, OpenAIEngine
    from codeloop.engine.protocol import SamplingParams

    fmt = trainer_fmt
    _, served, cfg = _served_policy(fmt, sft_weights, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(served)  # knows its directory, as a policy does
    cfg.rollout.backend, cfg.trainer.lora.rank = "openai", RANK
    cfg.trainer.lr = 1e-2  # adapters start at zero: a LoRA run takes a larger rate
    cfg.rollout.reload_check_tol = 1e-4  # each step's merge checked against the trainer
    prompt = fmt.prompt_ids(PROBLEMS[0].problem)

    async def main(url: str) -> tuple[Any, Any, int, int]:
        cfg.rollout.endpoints = [url]
        async with LocalSandbox(cfg.sandbox) as sandbox:
            logger = RunLogger(tmp_path / "run")
            run = build_run(cfg, model, fmt, PROBLEMS, tools=sandbox, logger=logger)
            try:
                await run.train(2)
                sent = len(run.rollout.sink._sent[0])  # type: ignore[attr-defined]
                server = OpenAIEngine(url)
                generation = await server.generate(prompt, SamplingParams(8, 1.0, seed=3))
                version = await server.served_version()
                await server.close()
            finally:
                logger.close()
                await run.close()
        return run, generation, sent, version

    with codeloop_serve(served) as url:
        run, generation, sent, version = asyncio.run(main(url))
    assert version == 2
    full = sum(t.numel() * 4 for t in sft_weights.values())  # float32 on a CPU run
    assert sent * 10 < full  # the adapters, not the model
    ids = torch.tensor([prompt + generation.token_ids])
    original = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
    original.load_state_dict(sft_weights)
    with torch.no_grad():
        trained = _chosen_logprobs(run.learner.model, ids, len(prompt))
        before = _chosen_logprobs(original, ids, len(prompt))
    assert generation.logprobs == pytest.approx(trained, abs=1e-5)  # the server merged them
    assert max(abs(a - b) for a, b in zip(trained, before, strict=True)) > 2e-4
    # The last checkpoint is a LoRA policy that loads on its own as the merged model.
    loaded = Policy.load(tmp_path / "run" / "checkpoints" / "step_000002" / "model").model
    merged = lora.merged_state(run.learner.model)
    assert all(torch.allclose(loaded.state_dict()[k], v, atol=1e-6) for k, v in merged.items())

    # A server started with another base refuses the adapters, and the run stops saying why.
    other = tmp_path / "other"
    tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2, seed=5).save_pretrained(other)
    fmt.tokenizer.save_pretrained(other)

    async def elsewhere(url: str) -> None:
        cfg.rollout.endpoints, cfg.trainer.output_dir = [url], str(tmp_path / "run2")
        fresh = AutoModelForCausalLM.from_pretrained(served)
        async with LocalSandbox(cfg.sandbox) as sandbox:
            logger = RunLogger(tmp_path / "run2")
            run = build_run(cfg, fresh, fmt, PROBLEMS, tools=sandbox, logger=logger)
            try:
                with pytest.raises(EngineError, match="trained on the base model"):
                    await run.train(1)
            finally:
                logger.close()
                await run.close()

    with codeloop_serve(other) as url:
        asyncio.run(elsewhere(url))
