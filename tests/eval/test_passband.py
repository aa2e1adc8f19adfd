import asyncio
import json
import subprocess
import sys
from pathlib import Path

from eval_helpers import PROBLEMS, ScriptedPolicy, cfg_for_eval, read_jsonl

from codeloop.config import eval_rollout_config
from codeloop.engine.model import tiny_model
from codeloop.eval.passrate import pass_band
from codeloop.reward import Verifier
from codeloop.rollout.collect import Agent
from codeloop.rollout.prompt import PromptFormat
from codeloop.sandbox.pool import LocalSandbox


def test_pass_band_keeps_the_problems_inside_the_band(fmt: PromptFormat) -> None:
    cfg = cfg_for_eval()  # problem a: the scripted policy gets a of its 4 samples right

    async def main() -> tuple[list, list]:
        verifier = Verifier(cfg.reward)
        try:
            async with LocalSandbox(cfg.sandbox) as tools:
                agent = Agent(ScriptedPolicy(fmt), tools, fmt, eval_rollout_config(cfg))
                return await pass_band(agent, PROBLEMS, 4, verifier, low=0.25, high=0.75)
        finally:
            verifier.close()

    kept, removed = asyncio.run(main())
    assert [p.id for p in kept] == ["p1", "p2", "p3"]  # pass rates 0.25, 0.5, 0.75
    assert [(r.id, r.reason, r.detail) for r in removed] == [
        ("p0", "pass_rate", "0.000 outside [0.25, 0.75]"),
        ("p4", "pass_rate", "1.000 outside [0.25, 0.75]"),
    ]


def test_filter_command_with_a_pass_band(fmt: PromptFormat, tmp_path: Path) -> None:
    model_dir = tmp_path / "policy"
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=1, heads=4).save_pretrained(model_dir)
    fmt.tokenizer.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(p.__dict__) + "\n" for p in PROBLEMS[:2]))
    command = [
        sys.executable,
        "-m",
        "codeloop",
        "data",
        "filter",
        str(data),
        "--out",
        str(tmp_path / "hard.jsonl"),
        "--pass-band",
        "0.5",
        "1",
        "--model",
        str(model_dir),
        "--k",
        "2",
        "--eval.max_response_tokens",
        "16",
        "--sandbox.workers",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # a random policy solves nothing: both problems fall below the band, with their rates
    assert (tmp_path / "hard.jsonl").read_text() == ""
    removed = read_jsonl(tmp_path / "hard.removed.jsonl")
    assert [(r["id"], r["reason"], r["detail"]) for r in removed] == [
        ("p0", "pass_rate", "0.000 outside [0.5, 1.0]"),
        ("p1", "pass_rate", "0.000 outside [0.5, 1.0]"),
    ]
