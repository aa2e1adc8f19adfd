"""The prompt format: problem -> prompt token ids, tool observation -> inserted token ids.

Everything comes from a chat template (Jinja, as in Hugging Face tokenizers), so a user can swap
it: `rollout.chat_template` names a file (one under `codeloop/` that is not found from the working
directory is read from the installed package). Empty means the model's own template (its
tokenizer's) where that template can prompt an agent (`own_template_gap`: it lists the tools'
schemas and renders a tool message), else `rstar2_chat_template.jinja`, markup in the style of the
rStar2-Agent report (Qwen-style turns, tools described in the system turn, `<reason>`), and one
line on the console says what the model's template lacks. The wording of the system prompt and of
the user's instruction is codeloop's own (`SYSTEM_PROMPT`, `USER_INSTRUCTION`), replaced by
`rollout.system_prompt` and `rollout.user_instruction`. The tokens the environment inserts after a
tool call (the end of the assistant turn, the tool response turn, the next assistant header) are
found by rendering a conversation with and without a tool message around marker strings, so any
template with a `tool` role works. Token-in, token-out: sampled tokens are never re-tokenised;
only inserted text is encoded.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from codeloop.config import POLICY_SETTINGS, POLICY_TEMPLATE
from codeloop.engine.model import end_of_turn_ids
from codeloop.errors import ModelError, read_text_input
from codeloop.rollout.environment import environment_schemas, schemas_by_environment
from codeloop.rollout.toolcall import CALL_CLOSE
from codeloop.rollout.tools import PYTHON_SCHEMA, tool_schemas

DEFAULT_TEMPLATE = Path(__file__).with_name("rstar2_chat_template.jinja")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds codeloop/
SYSTEM_PROMPT = (
    "You are a helpful assistant that solves problems step by step. Reason inside "
    "<reason> </reason>; you may run Python code with the tool to compute or check any step. "
    "Give the final answer inside <answer> </answer>."
)
USER_INSTRUCTION = (
    "Solve the following problem. Put the final answer inside <answer> </answer>, with the "
    "number in \\boxed{{}}.\n\n{problem}"
)
STOP_STRINGS = [CALL_CLOSE]
# `[rollout]` settings that shape a trajectory's turns, saved beside a trained policy (the
# trajectory's budgets and sampling at evaluation are `[eval]`'s, saved with them)
TURN_SETTINGS = (
    "max_tokens_per_turn",
    "max_tool_response_chars",
    "tools",
    "environment",
    "environments",
    "environment_reward",
    "action_parser",
)
_ASSISTANT_MARK, _TOOL_MARK = "\x00ASSISTANT\x00", "\x00OBSERVATION\x00"


_SAID: set[str] = set()  # the lines `_own_template` printed (once each a process)


def own_template_gap(tokenizer: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """What the tokenizer's own chat template lacks to prompt an agent with `tools`: None when
    it renders a conversation with a tool call and its output, listing each tool's schema (its
    description) and the tool message."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the one for tools, else the default
        own = own.get("tool_use") or own.get("default")
    if not own:
        return "it has none"
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _ASSISTANT_MARK},
        {"role": "tool", "content": _TOOL_MARK},
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=list(tools), chat_template=own, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
    except Exception as err:  # a template's own error (jinja's, or raise_exception)
        return f"it fails on a conversation with a tool call ({err})"
    described = [t.get("function", t).get("description", "") for t in tools]
    if not all(d in text for d in described):
        return "it does not list the tools"
    if _TOOL_MARK not in text:
        return "it does not render a tool message"
    return None


def _own_template(tokenizer: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """The tokenizer's own chat template where it can prompt an agent, else None (and one line
    on stderr, once a process, on what it lacks, unless it has none)."""
    gap = own_template_gap(tokenizer, tools)
    if gap is None:
        own = tokenizer.chat_template
        return str(own.get("tool_use") or own.get("default") if isinstance(own, dict) else own)
    line = (
        f"rollout.chat_template is empty and the model's own chat template cannot prompt with "
        f"tools ({gap}): using codeloop's {DEFAULT_TEMPLATE.name}"
    )
    if gap != "it has none" and line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)
    return None


class PromptFormat:
    """Renders prompts and tool responses with one tokenizer and one chat template."""

    def __init__(
        self,
        tokenizer: Any,
        template_path: str = "",
        system_prompt: str = SYSTEM_PROMPT,
        user_instruction: str = USER_INSTRUCTION,
        *,
        tools: Sequence[dict[str, Any]] = (PYTHON_SCHEMA,),
        per_environment: Mapping[str, Sequence[dict[str, Any]]] | None = None,
    ) -> None:
        """`tools`: the schemas of the tools the prompt lists (the agent's, `tools.py`);
        `per_environment`: those of each environment of `rollout.environments`, listed after
        `tools` in the prompts of the problems that name it (`prompt_ids`)."""
        self.tokenizer = tokenizer
        self.system_prompt, self.user_instruction = system_prompt, user_instruction
        self.listed = {
            name: [*tools, *schemas] for name, schemas in (per_environment or {}).items()
        }  # the tools each environment's prompts list
        # every tool a prompt may list (the policy's record of what it saw)
        self.tools = list(tools)
        for schemas in self.listed.values():
            self.tools += [schema for schema in schemas if schema not in self.tools]
        own = None if template_path else _own_template(tokenizer, self.tools)
        path = Path(template_path) if template_path else DEFAULT_TEMPLATE
        inside = PACKAGE_ROOT / path  # `codeloop/recipe/x.jinja`, wherever codeloop is installed
        if not path.is_file() and not path.is_absolute() and inside.is_file():
            path = inside
        self.template = own or read_text_input(path, "rollout.chat_template")
        self.eval_settings: dict[str, Any] = {}  # saved beside a trained policy
        self.turn_settings: dict[str, Any] = {}  # the rollout budgets it was trained with
        self._tool_prefix, self._tool_suffix = self._tool_turn()
        self.end_of_turn_ids = end_of_turn_ids(tokenizer)
        # the tool turn's prefix after a turn that ended with its own end-of-turn token: without
        # the turn end
        ends = [tokenizer.decode([token]) for token in self.end_of_turn_ids]
        prefix = self._tool_prefix
        self._tool_prefix_after_end = next(
            (prefix[len(end) :] for end in ends if end and prefix.startswith(end)), prefix
        )

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: Any, eval_cfg: Any = None) -> PromptFormat:
        """The format a `RolloutConfig` names: its template, system prompt and instruction;
        `eval_cfg` (an `EvalConfig`), the evaluation settings saved beside a trained policy."""
        fmt = cls(
            tokenizer,
            cfg.chat_template,
            cfg.system_prompt or SYSTEM_PROMPT,
            cfg.user_instruction or USER_INSTRUCTION,
            tools=tool_schemas(cfg.tools) + environment_schemas(cfg.environment),
            per_environment=schemas_by_environment(cfg.environments),
        )
        fmt.eval_settings = dataclasses.asdict(eval_cfg) if eval_cfg is not None else {}
        fmt.turn_settings = {key: copy.copy(getattr(cfg, key)) for key in TURN_SETTINGS}
        return fmt

    def save_pretrained(self, directory: str | Path) -> None:
        """The tokenizer, and beside it what renders this format (the template's text, the
        system prompt, the instruction), the budgets of a turn it was trained with
        (`TURN_SETTINGS`) and the evaluation settings (trajectory budgets, turn limit,
        sampling), so that `codeloop eval --model DIR` prompts and samples a trained policy as
        it was trained (`config.POLICY_SETTINGS`), with the tools it was trained with
        (`rollout.tools`). The stop strings and the tools' schemas are recorded too
        (`trajectory`): what the policy saw."""
        out = Path(directory)
        # the tokenizer carries the template the policy was prompted with, so that another
        # tool's `apply_chat_template` renders codeloop's prompts (the tokenizer in use keeps
        # its own)
        own = self.tokenizer.chat_template
        self.tokenizer.chat_template = self.template
        try:
            self.tokenizer.save_pretrained(out)
        finally:
            self.tokenizer.chat_template = own
        (out / POLICY_TEMPLATE).write_text(self.template)
        rollout = {
            "chat_template": POLICY_TEMPLATE,
            "system_prompt": self.system_prompt,
            "user_instruction": self.user_instruction,
            **self.turn_settings,
        }
        settings = {
            "rollout": rollout,
            "eval": self.eval_settings,
            "trajectory": {"stop": STOP_STRINGS, "tools": self.tools},
        }
        (out / POLICY_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")

    def render(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text of `messages`, listing `tools` (default: every tool)."""
        text: str = self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools if tools is None else tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return text

    def messages(self, problem: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.user_instruction.format(problem=problem)},
        ]

    def prompt_ids(self, problem: str, appended: str = "", environment: str = "") -> list[int]:
        """The prompt of `problem`; `appended`: text after the user's message (what an
        environment's `reset` returned, as TRL appends it); `environment`: the name of the
        problem's environment in `rollout.environments`, whose tools it lists."""
        messages = self.messages(problem)
        messages[-1]["content"] += appended
        tools = self.listed[environment] if environment else None
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def tool_response_ids(self, observation: str, after_end: bool = False) -> list[int]:
        """The tokens inserted after a `</tool_call>`: turn end, tool turn, next header;
        `after_end`: after a turn that ended with its own end-of-turn token (an action read by
        `rollout.action_parser`), so without the turn end."""
        prefix = self._tool_prefix_after_end if after_end else self._tool_prefix
        return self.encode(prefix + observation + self._tool_suffix)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _tool_turn(self) -> tuple[str, str]:
        base = [*self.messages("p"), {"role": "assistant", "content": _ASSISTANT_MARK}]
        with_tool = [*base, {"role": "tool", "content": _TOOL_MARK}]
        text = self.render(with_tool, add_generation_prompt=True)
        after_call = text[text.index(_ASSISTANT_MARK) + len(_ASSISTANT_MARK) :]
        if _TOOL_MARK not in after_call:
            raise ModelError(
                "the chat template does not render a 'tool' message (no tool "
                "support?): give rollout.chat_template one that does"
            )
        prefix, _, suffix = after_call.partition(_TOOL_MARK)
        return prefix, suffix
