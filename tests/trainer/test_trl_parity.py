"""codeloop's GRPO loss is TRL's: one fixed batch through TRL's `GRPOTrainer` (its advantages
from `_generate_and_score_completions` with generation replaced by fixed completions, its loss
from `_compute_loss`) and through codeloop's (`group_advantages`, `collate`, `token_logprobs`,
`policy_loss`) gives the same loss and the same gradient, in float64.

Matching settings: TRL `beta=0`, `epsilon`/`epsilon_high` = `algo.clip_low`/`clip_high`,
`loss_type="dapo"` (the sum over the batch's completion tokens divided by their count: codeloop's
token-level mean), `scale_rewards` "group"/"none" = `algo.adv_scale`, and TRL's std epsilon
1e-4 = `algo.adv_eps`. TRL's `tool_mask` is codeloop's masked tool output. Where codeloop
differs by design, a test below names the setting and shows the difference.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import trainer_fmt  # noqa: F401  (the session fixture)

from codeloop.algo.advantage import group_advantages
from codeloop.algo.loss import policy_loss
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.batch import Sample, collate, token_logprobs

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[dev]' has it)")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (trl needs it)")

G = 4  # samples per prompt
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]]  # equal lengths: TRL pads them on the left
COMPLETIONS = [  # unequal lengths, no end-of-text token (TRL would cut the mask there)
    [31, 32, 33],
    [34, 35, 36, 37, 38, 39],
    [40, 41],
    [42, 43, 44, 45],
    [50, 51, 52, 53, 54],
    [55],
    [56, 57, 58],
    [59, 60, 61, 62, 63, 64, 65],
]
# Tool output inside a completion: trained by neither (TRL's tool_mask 0, codeloop's loss mask 0)
TOOL_MASKS = [[1] * len(c) for c in COMPLETIONS]
TOOL_MASKS[1] = [1, 1, 0, 0, 1, 1]
TOOL_MASKS[7] = [1, 0, 0, 0, 1, 1, 1]
OFFSETS = [0.3, -0.25, 0.1, -0.05, 0.0, 0.35, -0.4, 0.02]  # old logprob = new - offset * (pos + 1)
CLIP_LOW, CLIP_HIGH, TRL_STD_EPS = 0.2, 0.28, 1e-4


def _trl_trainer(model: Any, tokenizer: Any, rewards: list[float], scale: str, out: Path) -> Any:
    by_completion = {tuple(c): r for c, r in zip(COMPLETIONS, rewards, strict=True)}

    def reward(completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [by_completion[tuple(ids)] for ids in completion_ids]

    config = trl.GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=len(COMPLETIONS),
        num_generations=G,
        max_completion_length=8,
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        loss_type="dapo",
        scale_rewards=scale,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    dataset = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    prompts = [p for p in PROMPTS for _ in range(G)]

    def fixed(_prompts: list[Any]) -> tuple[Any, ...]:  # generation: the fixed completions
        texts = [tokenizer.decode(c) for c in COMPLETIONS]
        return prompts, COMPLETIONS, TOOL_MASKS, texts, None, {}, None, None

    trainer._generate = fixed
    trainer.current_gradient_accumulation_steps = 1  # as its training loop sets it
    return trainer


def _trl_side(
    fmt: PromptFormat, model: Any, rewards: list[float], scale: str, out: Path
) -> tuple[float, list[torch.Tensor], list[float]]:
    trainer = _trl_trainer(model, fmt.tokenizer, rewards, scale, out)
    trainer.model.train()
    rows = [{"prompt": text} for text in ("a", "b") for _ in range(G)]
    inputs = trainer._generate_and_score_completions(rows)
    with torch.no_grad():  # the sampling policy's logprobs: the current ones moved by OFFSETS
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].size(1),
        )
    steps = torch.arange(1, logps.size(1) + 1, dtype=logps.dtype)
    inputs["old_per_token_logps"] = logps - torch.tensor(OFFSETS).unsqueeze(1) * steps
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in trainer.model.parameters()]
    return float(loss), grads, inputs["advantages"].tolist()


def _codeloop_side(
    model: Any, rewards: list[float], scale: bool
) -> tuple[float, list[torch.Tensor], list[float]]:
    advantages = []
    for start in range(0, len(rewards), G):
        advantages += group_advantages(rewards[start : start + G], TRL_STD_EPS, scale=scale)
    prompts = [p for p in PROMPTS for _ in range(G)]
    samples = [
        Sample(p + c, [0] * len(p) + m, [0.0] * (len(p) + len(c)), advantage=a)
        for p, c, m, a in zip(prompts, COMPLETIONS, TOOL_MASKS, advantages, strict=True)
    ]
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        current, _ = token_logprobs(model, batch)  # [B, T-1]
    old = current.clone()
    for row, (p, c) in enumerate(zip(prompts, COMPLETIONS, strict=True)):
        positions = torch.arange(1, len(c) + 1, dtype=old.dtype)
        old[row, len(p) - 1 : len(p) - 1 + len(c)] -= OFFSETS[row] * positions
    tokens = int(batch["loss_mask"][torch.tensor(advantages) != 0].sum())  # tokens with signal
    logprobs, _ = token_logprobs(model, batch)
    loss, _ = policy_loss(
        logprobs,
        old * batch["loss_mask"],
        batch["advantages"],
        batch["loss_mask"],
        denominator=tokens,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
    )
    loss.backward()
    return float(loss), [p.grad.detach().clone() for p in model.parameters()], advantages


def _both(
    fmt: PromptFormat, rewards: list[float], scale: str, tmp_path: Path
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4, seed=0).double()
    theirs = _trl_side(fmt, copy.deepcopy(model), rewards, scale, tmp_path)
    ours = _codeloop_side(copy.deepcopy(model), rewards, scale == "group")
    return theirs, ours


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "none"])
def test_the_same_batch_gives_trls_loss_and_gradient(
    trainer_fmt: PromptFormat,  # noqa: F811
    scale: str,
    tmp_path: Path,
) -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.0]  # both groups with signal
    (trl_loss, trl_grads, trl_adv), (loss, grads, adv) = _both(
        trainer_fmt, rewards, scale, tmp_path
    )
    assert adv == pytest.approx(trl_adv, abs=1e-6)  # TRL holds rewards in float32
    if scale == "none":  # Dr. GRPO: rewards minus the group mean
        assert adv[:G] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert loss == pytest.approx(trl_loss, abs=1e-6)
    assert trl_loss != 0
    for ours, theirs in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert max(float(g.abs().max()) for g in grads) > 1e-3  # a gradient, not zeros


@pytest.mark.slow
def test_a_group_without_signal_leaves_codeloops_denominator(
    trainer_fmt: PromptFormat,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`algo.drop_zero_signal_groups` aside, a group whose rewards are all equal trains nothing
    in either; TRL still counts its tokens in the loss's denominator, codeloop does not (its
    mean is over the tokens that carry signal), so TRL's loss is codeloop's times signal/all."""
    rewards = [1.0, 0.0, 0.0, 1.0] + [1.0] * G  # the second group: all correct
    (trl_loss, _, trl_adv), (loss, _, adv) = _both(trainer_fmt, rewards, "group", tmp_path)
    assert adv == pytest.approx(trl_adv, abs=1e-6) and adv[G:] == [0.0] * G
    signal = sum(sum(m) for m in TOOL_MASKS[:G])  # 3 + 4 + 2 + 4 = 13
    everything = sum(sum(m) for m in TOOL_MASKS)  # 13 + 5 + 1 + 3 + 4 = 26
    assert (signal, everything) == (13, 26)
    assert trl_loss == pytest.approx(loss * signal / everything, abs=1e-6)
