"""The trainer on a GPU: SFT and RL steps run on CUDA, with the rollout engine beside them.
Skipped without CUDA (the `gpu` marker)."""

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from trainer_helpers import conversation

from codeloop.config import Config, SandboxConfig, SFTConfig
from codeloop.data.problems import Problem
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox
from codeloop.trainer import distributed
from codeloop.trainer.logs import RunLogger
from codeloop.trainer.rl import RLRun, build_run
from codeloop.trainer.sft import train_sft

pytestmark = pytest.mark.gpu
PAIRS = [(1, 2), (3, 4), (10, 20), (7, 8)]


def test_a_world_of_one_is_on_the_gpu() -> None:
    assert distributed.init().device.type == "cuda"


def test_sft_then_two_rl_steps_on_the_gpu(trainer_fmt: PromptFormat, tmp_path: Path) -> None:
    fmt = trainer_fmt
    world = distributed.World(device=torch.device("cuda"), compute_dtype=torch.bfloat16)
    model = distributed.shard(tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2), world)
    assert next(model.parameters()).is_cuda
    data = [conversation(fmt, a, b) for a, b in PAIRS]
    sft = SFTConfig(epochs=60, lr=1e-2, warmup_steps=5, conversations_per_step=4)
    history = train_sft(model, fmt, data, sft, world=world)
    assert history[-1]["sft/loss"] < 0.3 * history[0]["sft/loss"]
    before = copy.deepcopy(model.state_dict())
    cfg = Config()
    cfg.trainer.output_dir, cfg.trainer.lr, cfg.trainer.warmup_steps = str(tmp_path), 1e-3, 0
    cfg.trainer.prompts_per_step, cfg.algo.group_size, cfg.algo.oversample = 2, 2, 2
    cfg.rollout.max_response_tokens, cfg.rollout.max_turns, cfg.reward.workers = 200, 3, 1
    problems = [
        Problem(f"p{i}", f"What is {a} + {b}?", str(a + b)) for i, (a, b) in enumerate(PAIRS)
    ]

    async def rl() -> tuple[list[dict[str, float]], RLRun]:
        async with LocalSandbox(SandboxConfig(workers=1)) as sandbox:
            logger = RunLogger(tmp_path)
            run = build_run(cfg, model, fmt, problems, tools=sandbox, logger=logger, world=world)
            try:
                return await run.train(2), run
            finally:
                logger.close()
                await run.close()

    metrics, run = asyncio.run(rl())
    assert next(run.rollout.engines[0].model.parameters()).is_cuda
    assert all(
        p.dtype == torch.float32 for p in run.learner.model.parameters()
    )  # bf16 compute only
    assert metrics[0]["loss/policy_tokens"] > 0 and metrics[0]["rollout/tool_calls"] > 0
    after = run.learner.model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items())  # every parameter moved
    served = run.rollout.engines[0].model.state_dict()
    for name, value in after.items():  # the engine samples with the trained weights, in bf16
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(value.to(torch.bfloat16), served[name])


def test_a_profiled_step_on_the_gpu_reports_its_kernels(tmp_path: Path) -> None:
    from codeloop.trainer.profile import StepProfile

    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    profile = StepProfile(device)
    profile.start()
    for _ in range(20):
        x = torch.tanh(x @ x)
    metrics = profile.stop(tmp_path, 7)
    assert metrics["profile/gpu_kernels_s"] > 0 and 0 < metrics["profile/gpu_share"] <= 1.05
    # one stream: its kernels run one after another, within the span from the first to the last
    assert metrics["profile/gpu_kernels_s"] <= metrics["profile/gpu_span_s"] * 1.001
    summary, table = (tmp_path / "profile_step_000007.txt").read_text().split("\n\n", 1)
    assert summary.startswith("RL step 7: ") and "GPU kernels" in summary
    ops = [line.lower() for line in table.splitlines()[1:]]  # kernel names may hold spaces
    assert any("gemm" in op or "cutlass" in op for op in ops)  # the matmuls' kernels
    assert not any(op.startswith("aten::") for op in ops)  # the GPU's timeline only
