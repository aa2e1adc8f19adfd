"""A scripted policy with known right and wrong samples, and one evaluation run of it."""

import asyncio
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from codeloop.config import Config
from codeloop.data.problems import Problem
from codeloop.data.tokenizer import train_tokenizer
from codeloop.engine.protocol import Generation, SamplingParams
from codeloop.eval.evaluate import evaluate
from codeloop.rollout.prompt import PromptFormat
from codeloop.rollout.tools import PYTHON_TOOL
from codeloop.sandbox.pool import LocalSandbox

K = 4
# Problem a asks for a + a. The scripted policy gets the first (a % 5) of its samples right.
PROBLEMS = [Problem(f"p{a}", f"What is {a} + {a}?", str(2 * a)) for a in range(5)]


@pytest.fixture(scope="session")
def fmt() -> PromptFormat:
    corpus = ["What is 12 + 34? print(46) <answer>\\boxed{46}</answer> ok bad retry"] * 50
    return PromptFormat(train_tokenizer(corpus, vocab_size=400))


def _call(code: str) -> str:
    call = json.dumps({"name": PYTHON_TOOL, "arguments": {"code": code}})
    return f"<tool_call>\n{call}\n</tool_call>"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class ScriptedPolicy:
    """Right samples call the tool (problem 3 first fails with 1/0) and box its output; wrong
    ones box a + a + 1 without the tool. The first turn's `ok`/`bad` carries the choice."""

    def __init__(self, fmt: PromptFormat) -> None:
        self.fmt = fmt
        self.first_turns: Counter[int] = Counter()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        text = self.fmt.tokenizer.decode(prompt_ids)
        a = int(re.search(r"What is (\d+) \+", text).group(1))  # type: ignore[union-attr]
        history = text.split("What is", 1)[1]
        calls = history.count("</tool_call>")
        if calls == 0 and "ok" not in history and "bad" not in history:
            right = self.first_turns[a] < a % (K + 1)
            self.first_turns[a] += 1
            reply = "ok" + _call("1/0" if a == 3 else f"print({a} + {a})") if right else "bad"
            if not right:
                reply += f"</reason><answer>\\boxed{{{2 * a + 1}}}</answer>"
        elif a == 3 and calls == 1:
            reply = "retry" + _call(f"print({a} + {a})")
        else:
            output = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", history, re.S)[-1]
            reply = f"</reason><answer>\\boxed{{{output.split()[-1]}}}</answer>"
        ids = self.fmt.encode(reply)
        return Generation(ids, [-0.5] * len(ids), "stop")


def cfg_for_eval() -> Config:
    cfg = Config()
    cfg.eval.k, cfg.eval.max_response_tokens = K, 400
    cfg.sandbox.workers = 2
    return cfg


def run_eval(fmt: PromptFormat, out: Path, policy: ScriptedPolicy) -> dict:
    async def main() -> dict:
        async with LocalSandbox(cfg_for_eval().sandbox) as tools:
            return await evaluate(
                policy, tools, fmt, PROBLEMS, cfg=cfg_for_eval(), out_dir=out, concurrency=2
            )

    return asyncio.run(main())


@pytest.fixture(scope="session")
def scripted_run(fmt: PromptFormat, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("eval") / "run"
    return out, run_eval(fmt, out, ScriptedPolicy(fmt))
