import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eval_helpers import read_jsonl

from codeloop.engine.model import tiny_model
from codeloop.eval.entropy import after_tool_flags, analyse, analyse_file, response_entropies
from codeloop.rollout.prompt import PromptFormat


def test_after_tool_flags_mark_the_first_policy_tokens_after_an_inserted_span() -> None:
    mask = [1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert after_tool_flags(mask, 2) == [False, False, False, False, True, True, False, False, True]
    assert after_tool_flags(mask, 0) == [False] * 9
    assert after_tool_flags([1, 1, 1], 5) == [False] * 3  # the first turn follows the prompt


def test_analyse_splits_the_top_fraction_by_position() -> None:
    # 10 policy tokens, top 20% = the 2 highest (0.9 "Wait" after a tool response, 0.8 "so")
    tokens = ["a", "b", "Wait", "c", "so", "d", "e", "f", "g", "h", "i"]
    entropies = [0.1, 0.2, 0.9, None, 0.8, 0.3, 0.1, 0.2, 0.3, 0.4, 0.5]
    after = [False, False, True, False, False, False, False, False, False, False, False]
    report = analyse([(tokens, entropies, after)], top_fraction=0.2)
    assert report.policy_tokens == 10
    assert report.threshold == 0.8
    assert (report.high_after_tool, report.high_other) == (1, 1)
    assert report.after_tool == [("Wait", 1)] and report.other == [("so", 1)]
    report = analyse([(tokens, entropies, after)] * 2, top_fraction=0.25)  # 5 of 20
    assert report.threshold == 0.5
    assert report.after_tool == [("Wait", 2)] and report.other == [("so", 2), ("i", 1)]
    with pytest.raises(ValueError, match="no policy tokens"):
        analyse([(["x"], [None], [False])])


def test_entropies_align_with_the_distribution_each_token_was_sampled_from() -> None:
    model = tiny_model(50, hidden_size=32, layers=2, heads=4).eval()
    prompt, response, mask = [1, 2, 3], [4, 5, 6, 7], [1, 0, 1, 1]
    got = response_entropies(model, prompt, response, mask)
    assert got[1] is None
    for i in (0, 2, 3):  # token i was drawn from the distribution after prompt + response[:i]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response[:i]])).logits[0, -1]
        p = torch.softmax(logits.double(), -1)
        assert got[i] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-4)
    with torch.no_grad():  # a model that predicts nothing: log V everywhere
        model.lm_head.weight.zero_()
    uniform = response_entropies(model, prompt, response, mask)
    assert [h for h in uniform if h is not None] == pytest.approx([math.log(50)] * 3, rel=1e-5)


def test_entropy_command_on_evaluated_trajectories(
    scripted_run: tuple[Path, dict], fmt: PromptFormat, tmp_path: Path
) -> None:
    out, _ = scripted_run
    model_dir = tmp_path / "policy"
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4).save_pretrained(model_dir)
    fmt.tokenizer.save_pretrained(model_dir)
    target = tmp_path / "entropy.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codeloop",
            "entropy",
            "--model",
            str(model_dir),
            str(out / "trajectories.jsonl"),
            "--out",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "right after a tool response" in done.stdout
    result = json.loads(target.read_text())
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert len(result["trajectories"]) == len(trajectories)
    for t, e in zip(trajectories, result["trajectories"], strict=True):
        assert (e["prompt_id"], e["sample_index"]) == (t["prompt_id"], t["sample_index"])
        assert [h is None for _, h in e["tokens"]] == [m == 0 for m in t["loss_mask"]]
    report = result["report"]
    assert report["policy_tokens"] == sum(sum(t["loss_mask"]) for t in trajectories)
    top = math.ceil(0.2 * report["policy_tokens"])
    assert report["high_after_tool"] + report["high_other"] == top
    assert sum(n for _, n in report["after_tool"]) <= report["high_after_tool"]


def test_training_dumps_without_token_ids_are_refused(fmt: PromptFormat, tmp_path: Path) -> None:
    path = tmp_path / "step.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "sample_index": 0, "text": "x"}) + "\n")
    model = tiny_model(len(fmt.tokenizer), hidden_size=32, layers=1, heads=4)
    with pytest.raises(ValueError, match=r"step.jsonl:1: no prompt_ids, response_ids, loss_mask"):
        analyse_file(model, fmt.tokenizer, path)
