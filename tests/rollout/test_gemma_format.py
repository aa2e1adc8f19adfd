"""Gemma's turn markup (`gemma_chat_template.jinja`, the real recipe's format for Gemma 3, whose
base model ships no template), with a tokenizer that holds Gemma's turn tokens as special tokens:
the prompt opens with <bos>, a turn ends on <end_of_turn>, tool output is a user turn, and SFT
trains on the model's own turns alone."""

from pathlib import Path

import pytest

from codeloop.data.pretrained import PretrainedError, packaged
from codeloop.data.tokenizer import train_tokenizer
from codeloop.reward.extract import extract_answer
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.sft import encode_conversation

TEMPLATE = "codeloop/recipe/gemma_chat_template.jinja"


@pytest.fixture(scope="module")
def gemma() -> PromptFormat:
    tokenizer = train_tokenizer(["Solve 12 + 30. print(42) The answer is 42."] * 20, 300)
    tokenizer.add_special_tokens(  # Gemma's EOS is not its turn end
        {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
        }
    )
    return PromptFormat(tokenizer, TEMPLATE, "Be brief.", "Solve: {problem}")


def ids_of(fmt: PromptFormat, *tokens: str) -> list[int]:
    return [fmt.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def test_the_prompt_opens_with_bos_and_the_system_text_heads_the_user_turn(
    gemma: PromptFormat,
) -> None:
    ids = gemma.prompt_ids("12 + 30")
    assert ids[:2] == ids_of(gemma, "<bos>", "<start_of_turn>")
    assert gemma.tokenizer.decode(ids) == (
        "<bos><start_of_turn>user\nBe brief.\n\nSolve: 12 + 30<end_of_turn>\n"
        "<start_of_turn>model\n<reason>"
    )


def test_a_turn_ends_on_end_of_turn_and_tool_output_comes_back_as_a_user_turn(
    gemma: PromptFormat,
) -> None:
    end, eos = ids_of(gemma, "<end_of_turn>", "<eos>")
    assert {end, eos} <= gemma.end_of_turn_ids  # (the test vocabulary has ChatML's too)
    inserted = gemma.tool_response_ids("42")
    assert inserted[0] == end  # the turn the call ended is closed by the environment
    assert gemma.tokenizer.decode(inserted) == (
        "<end_of_turn>\n<start_of_turn>user\n<tool_response>\n42\n</tool_response>"
        "<end_of_turn>\n<start_of_turn>model\n"
    )


def test_sft_trains_on_the_model_turns_and_their_ends_alone(gemma: PromptFormat) -> None:
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(42)"}}\n</tool_call>'
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Solve: 12 + 30"},
        {"role": "assistant", "content": "<reason>Add.</reason>\n" + call},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"},
    ]
    sample = encode_conversation(gemma, messages)
    trained = [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    untrained = [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    decode = gemma.tokenizer.decode
    assert decode(trained) == "Add.</reason>\n" + call + "<answer>\\boxed{42}</answer><end_of_turn>"
    assert decode(untrained).startswith("<bos><start_of_turn>user\nBe brief.")
    assert decode(untrained).endswith(
        "<start_of_turn>model\n<reason><end_of_turn>\n"
        "<start_of_turn>user\n<tool_response>\n42\n"
        "</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    "text", ["The answer is 42<end_of_turn>", "The answer is 42<end_of_turn>\n<start_of_turn>user"]
)
def test_gemma_turn_tokens_are_not_part_of_an_answer(text: str) -> None:
    assert extract_answer(text, fallback_answer_phrase=True).answer == "42"


def test_a_packaged_model_that_is_not_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    monkeypatch.setenv("CODELOOP_CACHE", str(tmp_path))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3") else real_find(name, *a),
    )
    with pytest.raises(PretrainedError, match=r"pip install -e '\.\[gemma3\]'"):
        packaged("gemma3-270m")()
    with pytest.raises(PretrainedError, match="the names are smollm2, gemma3-270m"):
        packaged("gemma-7b")
