import json
import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import cli_inputs, conversation

from codeloop.config import Config, SFTConfig
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.run import run_sft
from codeloop.trainer.sft import SFTDataError, encode_conversation, load_conversations, train_sft


def test_sft_tokens_are_the_tokens_the_rollout_produces(trainer_fmt: PromptFormat) -> None:
    fmt = trainer_fmt
    messages = conversation(fmt, 12, 30)
    sample = encode_conversation(fmt, messages)
    turn1 = fmt.encode(messages[2]["content"].removeprefix("<reason>"))
    turn2 = fmt.encode(messages[4]["content"] + "<|im_end|>")
    expected = fmt.prompt_ids("What is 12 + 30?") + turn1 + fmt.tool_response_ids("42") + turn2
    assert sample.input_ids == expected
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert trained == turn1 + turn2  # only what the policy samples; tool tokens masked


def test_a_turn_that_breaks_the_template_is_named(trainer_fmt: PromptFormat) -> None:
    messages = conversation(trainer_fmt, 1, 2)
    messages[2]["content"] = "no reason tag"  # the template opens the first turn with <reason>
    with pytest.raises(SFTDataError, match="message 2: not rendered as a continuation"):
        encode_conversation(trainer_fmt, messages)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{oops", "data.jsonl:2: not JSON"),
        ('{"text": "x"}', 'data.jsonl:2: expected {"messages"'),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0: role must be one of"),
        ('{"messages": [{"role": "user", "content": 5}]}', "message 0: content must be a string"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant message"),
    ],
)
def test_data_errors_name_file_and_line(tmp_path: Path, line: str, error: str) -> None:
    good = json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    path = tmp_path / "data.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(SFTDataError, match=error.replace("[", r"\[").replace("{", r"\{")):
        load_conversations(str(path))


def test_sft_fits_a_few_conversations(trainer_fmt: PromptFormat) -> None:
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=64, layers=2)
    data = [conversation(trainer_fmt, a, b) for a, b in [(1, 2), (3, 4), (10, 20), (7, 8)]]
    cfg = SFTConfig(
        epochs=40, lr=3e-3, warmup_steps=5, conversations_per_step=4, micro_batch_tokens=300
    )
    history = train_sft(model, trainer_fmt, data, cfg)
    assert len(history) == 40
    assert history[-1]["sft/loss"] < 0.3 * history[0]["sft/loss"]
    assert history[0]["sft/tokens"] == sum(
        sum(encode_conversation(trainer_fmt, c).loss_mask[1:]) for c in data
    )


def test_stop_when_ends_training_and_a_later_phase_continues_the_step_numbers(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    model = tiny_model(len(trainer_fmt.tokenizer), hidden_size=32, layers=1)
    data = [conversation(trainer_fmt, a, a + 1) for a in range(8)]
    cfg = SFTConfig(epochs=5, conversations_per_step=2)  # 20 steps unless stopped
    asked: list[int] = []

    def stop_when(steps: int) -> bool:
        asked.append(steps)
        return steps == 3

    logged: list[int] = []
    rewound: list[int] = []

    class Steps:
        def log(self, step: int, metrics: dict[str, float]) -> None:
            logged.append(step)

        def rewind(self, step: int) -> None:  # what a killed attempt left past it is dropped
            rewound.append(step)

    first = train_sft(model, trainer_fmt, data, cfg, logger=Steps(), stop_when=stop_when)  # type: ignore[arg-type]
    assert len(first) == 3 and asked == [1, 2, 3]
    cfg.epochs = 1
    train_sft(model, trainer_fmt, data, cfg, logger=Steps(), first_step=3)  # type: ignore[arg-type]
    assert logged == [1, 2, 3, 4, 5, 6, 7] and rewound == [0, 3]


def test_a_conversation_over_the_token_limit_names_its_line(
    trainer_fmt: PromptFormat, tmp_path: Path
) -> None:
    base, sft_data, _ = cli_inputs(trainer_fmt, tmp_path)  # 3 conversations, lines 1-3
    lengths = [
        len(encode_conversation(trainer_fmt, c["messages"]).input_ids)
        for c in map(json.loads, sft_data.read_text().splitlines())
    ]
    cfg = Config()
    cfg.trainer.model, cfg.sft.data = str(base), str(sft_data)
    cfg.trainer.output_dir = str(tmp_path / "run")
    cfg.sft.max_tokens = sorted(lengths)[-2]  # only the longest is over
    longest = lengths.index(max(lengths)) + 1
    assert lengths.count(max(lengths)) == 1
    with pytest.raises(SFTDataError, match=f"^{sft_data}:{longest}: {max(lengths)} tokens > sft"):
        run_sft(cfg)


def test_warmup_ratio_is_a_share_of_all_steps() -> None:
    import torch

    from codeloop.trainer.sft import _schedule, warmup_steps

    cfg = SFTConfig(warmup_ratio=0.04, warmup_steps=99, min_lr_ratio=0.1)
    assert warmup_steps(cfg, 100) == 4 and warmup_steps(cfg, 101) == 5  # rounded up
    assert warmup_steps(SFTConfig(warmup_steps=7), 100) == 7  # no ratio: the step count
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = _schedule(optimizer, cfg, 100)
    factors = []
    for _ in range(100):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert factors[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])  # 4 warm-up steps, the peak
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)  # cosine down to min_lr_ratio


def test_the_sft_schedule_warms_up_then_decays_on_a_cosine_to_its_floor() -> None:
    from codeloop.trainer.sft import _schedule

    cfg = SFTConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    schedule = _schedule(optimizer, cfg, total_steps=6)
    rates = []
    for _ in range(7):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    # warm-up 1/2, 2/2; then 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..4
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert rates == pytest.approx([0.5, 1.0, *cosine])
    assert cosine[-1] == pytest.approx(0.1)
