from pathlib import Path

import pytest

from codeloop.errors import InputFileError, ModelError
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import PYTHON_TOOL


def test_the_default_prompt(fmt: PromptFormat) -> None:
    text = fmt.tokenizer.decode(fmt.prompt_ids("What is 2 + 3?"))
    assert text.startswith("<|im_start|>system\n")
    assert f'"name": "{PYTHON_TOOL}"' in text and "<tools>" in text
    assert "<|im_start|>user\nSolve the following problem." in text
    assert "\\boxed{}" in text and "What is 2 + 3?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<reason>")  # the first turn opens reasoning


def test_tool_responses_are_a_user_turn_then_a_new_assistant_header(fmt: PromptFormat) -> None:
    text = fmt.tokenizer.decode(fmt.tool_response_ids("42"))
    assert text == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    end = fmt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.end_of_turn_ids == {end}


def test_a_user_template(fmt: PromptFormat, tmp_path: Path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    plain = PromptFormat(fmt.tokenizer, str(template))
    assert plain.tokenizer.decode(plain.tool_response_ids("7")) == "\n[tool] 7\n[assistant] "
    assert plain.tokenizer.decode(plain.prompt_ids("q")).endswith("q\n[assistant] ")


def test_template_errors_name_the_problem(fmt: PromptFormat, tmp_path: Path) -> None:
    with pytest.raises(
        InputFileError, match="rollout.chat_template: .*missing.jinja: no such file"
    ):
        PromptFormat(fmt.tokenizer, str(tmp_path / "missing.jinja"))
    no_tools = tmp_path / "no_tools.jinja"
    no_tools.write_text("{% for m in messages if m.role != 'tool' %}{{ m.content }}{% endfor %}")
    with pytest.raises(ModelError, match="does not render a 'tool' message"):
        PromptFormat(fmt.tokenizer, str(no_tools))


def test_the_wording_comes_from_the_config(fmt: PromptFormat) -> None:
    from codeloop.config import RolloutConfig
    from codeloop.rollout.prompt import SYSTEM_PROMPT

    default = PromptFormat.from_config(fmt.tokenizer, RolloutConfig())
    assert SYSTEM_PROMPT in fmt.tokenizer.decode(default.prompt_ids("What is 2 + 3?"))
    cfg = RolloutConfig(system_prompt="Be brief.", user_instruction="Q: {problem}")
    text = fmt.tokenizer.decode(PromptFormat.from_config(fmt.tokenizer, cfg).prompt_ids("2 + 3?"))
    assert "Be brief." in text and "Q: 2 + 3?" in text and SYSTEM_PROMPT not in text


def test_an_empty_template_setting_takes_the_models_own_where_it_can_prompt_an_agent(
    fmt: PromptFormat, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    from codeloop.rollout import prompt

    monkeypatch.setattr(prompt, "_SAID", set())  # what earlier tests in this process printed

    tokenizer = copy.deepcopy(fmt.tokenizer)
    assert not tokenizer.chat_template  # none: codeloop's default, silently
    assert PromptFormat(tokenizer).template == prompt.DEFAULT_TEMPLATE.read_text()
    assert capsys.readouterr().err == ""
    # a template that lists the tools and renders tool messages (Qwen's way, cut short) is used
    tool_ready = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}{% if m.role == 'tool' %}<user><tool_response>{{ m.content }}"
        "</tool_response>{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tokenizer.chat_template = tool_ready
    assert prompt.own_template_gap(tokenizer, [prompt.PYTHON_SCHEMA]) is None
    own = PromptFormat(tokenizer)
    assert own.template == tool_ready
    text = own.tokenizer.decode(own.tool_response_ids("42"))
    assert text == "<user><tool_response>42</tool_response><assistant>"
    # a plain chat template without tools: the default, and one line on what it lacks, once
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert prompt.own_template_gap(tokenizer, [prompt.PYTHON_SCHEMA]) == (
        "it does not list the tools"
    )
    for _ in range(2):
        assert PromptFormat(tokenizer).template == prompt.DEFAULT_TEMPLATE.read_text()
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "own chat template cannot prompt with tools (it does not list the tools)" in err
    tokenizer.chat_template = "{{ raise_exception('no tools here') }}"
    gap = prompt.own_template_gap(tokenizer, [prompt.PYTHON_SCHEMA])
    assert gap is not None and gap.startswith("it fails on a conversation with a tool call")
    assert "no tools here" in gap
