"""`codeloop eval`: hand-computed metrics with a scripted policy, resume after a kill, and the
real thing end to end through `codeloop serve` with the local sandbox."""

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from eval_helpers import PROBLEMS, K, ScriptedPolicy, cfg_for_eval, read_jsonl, run_eval

from codeloop.data.problems import DataError
from codeloop.engine.model import tiny_model
from codeloop.eval.evaluate import evaluate
from codeloop.rollout.prompt import PromptFormat


def test_metrics_match_hand_computed_values(scripted_run: tuple[Path, dict]) -> None:
    _, summary = scripted_run
    # correct samples per problem: 0, 1, 2, 3, 4 of 4
    assert summary["problems"] == 5 and summary["k"] == K
    assert summary["pass@1"] == pytest.approx(10 / 20)  # avg@4
    assert summary["infrastructure_failures"] == 0
    # shares 0, 1/4, 1/2, 3/4, 1 resampled over problems: their standard deviation is
    # sqrt(1/8), the mean's standard error sqrt(1/40) = 0.158, so about 0.5 -+ 0.31
    low, high = summary["pass@1_low"], summary["pass@1_high"]
    assert low == pytest.approx(0.19, abs=0.05) and high == pytest.approx(0.81, abs=0.05)
    # pass@2: 0, 1 - C(3,2)/C(4,2) = 1/2, 1 - 1/6, 1, 1
    assert summary["pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1 + 1) / 5)
    assert summary["pass@4"] == pytest.approx(4 / 5)
    # maj@4: 1 of 4 right loses; 2 of 4 ties and the first-seen (right) answer wins
    assert summary["maj@4"] == pytest.approx(3 / 5)
    # tool calls: one per right sample, two for problem 3 (the first raises ZeroDivisionError)
    assert summary["tool_calls"] == pytest.approx(13 / 20)
    assert summary["tool_error_ratio"] == pytest.approx(3 / 13)
    assert summary["statuses"] == {"answered": 1.0}
    # the 10 right samples call the tool, the wrong ones do not; none is cut off or malformed
    assert summary["tool_use"] == pytest.approx(10 / 20)
    assert summary["cut_off_in_call"] == 0.0 and summary["malformed_calls"] == 0.0


def test_outputs_are_consistent(scripted_run: tuple[Path, dict]) -> None:
    out, summary = scripted_run
    results = read_jsonl(out / "results.jsonl")
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert sorted(r["id"] for r in results) == [p.id for p in PROBLEMS]
    assert len(trajectories) == 5 * K
    by_id = {r["id"]: r for r in results}
    assert by_id["p3"]["correct"] == [True, True, True, False]
    assert by_id["p3"]["answers"] == ["6", "6", "6", "7"]
    lengths = [len(t["response_ids"]) for t in trajectories]
    assert summary["response_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    assert json.loads((out / "summary.json").read_text()) == summary
    failed = [t for t in trajectories if t["prompt_id"] == "p3" and t["tool_calls"]]
    assert all(t["tool_calls"][0]["result"]["error_type"] == "ZeroDivisionError" for t in failed)


def test_a_killed_evaluation_resumes_where_it_stopped(
    fmt: PromptFormat, scripted_run: tuple[Path, dict], tmp_path: Path
) -> None:
    full_dir, full_summary = scripted_run
    out = tmp_path / "killed"
    shutil.copytree(full_dir, out)
    lines = (out / "results.jsonl").read_text().splitlines()
    # two problems finished, a third killed while its line was being written
    (out / "results.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:25])
    finished = {json.loads(line)["id"] for line in lines[:2]}
    policy = ScriptedPolicy(fmt)
    summary = run_eval(fmt, out, policy)
    assert sum(policy.first_turns.values()) == 3 * K  # only the three unfinished problems ran
    assert {f"p{a}" for a in policy.first_turns} == {p.id for p in PROBLEMS} - finished
    assert summary == full_summary
    assert len(read_jsonl(out / "results.jsonl")) == 5  # the cut line is gone, every line parses
    trajectories = read_jsonl(out / "trajectories.jsonl")
    keys = Counter((t["prompt_id"], t["sample_index"]) for t in trajectories)
    assert len(keys) == 5 * K and set(keys.values()) == {1}


def test_results_lines_of_an_older_format_are_named_not_misread(
    fmt: PromptFormat, scripted_run: tuple[Path, dict], tmp_path: Path
) -> None:
    full_dir, _ = scripted_run
    out = tmp_path / "older"
    shutil.copytree(full_dir, out)
    results = read_jsonl(out / "results.jsonl")
    older = [{k: v for k, v in r.items() if k != "failed"} for r in results[:1]]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in older + results[1:]))
    with pytest.raises(DataError, match="results.jsonl:1: a line without failed"):
        run_eval(fmt, out, ScriptedPolicy(fmt))


def test_another_k_in_the_same_directory_is_an_error(
    fmt: PromptFormat, scripted_run: tuple[Path, dict]
) -> None:
    out, _ = scripted_run
    cfg = cfg_for_eval()
    cfg.eval.k = 2
    with pytest.raises(ValueError, match="another k"):
        asyncio.run(evaluate(ScriptedPolicy(fmt), None, fmt, PROBLEMS, cfg=cfg, out_dir=out))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served_model(
    fmt: PromptFormat, tmp_path_factory: pytest.TempPathFactory, codeloop_serve: Any
) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("policy")
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4).save_pretrained(root)
    fmt.tokenizer.save_pretrained(root)
    with codeloop_serve(root) as url:
        yield url, root


@pytest.mark.slow
def test_eval_command_through_codeloop_serve(
    served_model: tuple[str, Path], tmp_path: Path
) -> None:
    url, model_dir = served_model
    data = tmp_path / "bench.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
            for p in PROBLEMS[:3]
        )
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "codeloop",
        "eval",
        "--endpoint",
        url,
        "--tokenizer",
        str(model_dir),
        "--data",
        str(data),
        "--k",
        "2",
        "--out",
        str(out),
        "--eval.max_response_tokens",
        "48",
        "--eval.max_turns",
        "3",
        "--sandbox.workers",
        "1",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if not line.startswith("eval: ")]
    assert said == [], done.stderr  # progress lines only: no "Unclosed client session"
    summary = json.loads((out / "summary.json").read_text())
    results = read_jsonl(out / "results.jsonl")
    assert sorted(r["id"] for r in results) == ["p0", "p1", "p2"]
    assert summary["problems"] == 3 and summary["k"] == 2
    assert sum(summary["statuses"].values()) == pytest.approx(1.0)
    trajectories = read_jsonl(out / "trajectories.jsonl")
    assert len(trajectories) == 6
    for t in trajectories:  # a random policy: budgets end most trajectories, nothing is lost
        assert len(t["response_ids"]) <= 48 + 200  # the last turn's tool response may overrun
        assert len(t["logprobs"]) == len(t["response_ids"]) == len(t["loss_mask"])
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and json.loads((out / "summary.json").read_text()) == summary


def _eval_command(url: str, model_dir: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "codeloop",
        "eval",
        "--endpoint",
        url,
        "--tokenizer",
        str(model_dir),
        "--data",
        str(data),
        "--k",
        "2",
        "--out",
        str(out),
        "--eval.max_response_tokens",
        "48",
        "--eval.max_turns",
        "3",
        "--sandbox.workers",
        "1",
        "--concurrency",
        "1",
    ]


def _bench_file(path: Path, count: int) -> Path:
    rows = [
        {"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_an_unreachable_server_stops_the_evaluation_naming_it(
    fmt: PromptFormat, tmp_path: Path
) -> None:
    fmt.tokenizer.save_pretrained(tmp_path / "tok")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    command = _eval_command(
        url, tmp_path / "tok", _bench_file(tmp_path / "b.jsonl", 2), tmp_path / "out"
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(f"codeloop eval: cannot reach the server at {url} (")
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_server_killed_mid_evaluation_scores_only_what_it_generated(
    fmt: PromptFormat, tmp_path: Path, codeloop_serve: Any
) -> None:
    model_dir = tmp_path / "policy"
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4).save_pretrained(model_dir)
    fmt.tokenizer.save_pretrained(model_dir)
    total, out = 60, tmp_path / "out"
    with codeloop_serve(model_dir) as url:
        command = _eval_command(url, model_dir, _bench_file(tmp_path / "b.jsonl", total), out)
        evaluation = subprocess.Popen(
            [*command, "--rollout.server_retry_s", "1"],  # not waiting for it to come back
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        results = out / "results.jsonl"
        while not results.is_file() or len(results.read_text().splitlines()) < 3:
            assert evaluation.poll() is None, evaluation.communicate()
            time.sleep(0.01)
        url.process.kill()  # mid-evaluation: problems one at a time, 57 or fewer to go
        stdout, stderr = evaluation.communicate(timeout=300)
    assert evaluation.returncode == 1, stderr
    summary = json.loads((out / "summary.json").read_text())
    scored = read_jsonl(results)
    assert 3 <= summary["problems"] == len(scored) < total
    # a problem without a line lost both its samples; one with a line may have lost one
    lost = 2 * (total - len(scored)) + sum(r["failed"] for r in scored)
    assert summary["infrastructure_failures"] == lost > 0
    assert summary["statuses"].get("error", 0.0) == 0.0  # none of the failures is scored
    assert all(len(r["correct"]) + r["failed"] == 2 and r["correct"] for r in scored)
    kept = sum(len(r["correct"]) for r in scored)
    assert len(read_jsonl(out / "trajectories.jsonl")) == kept
    assert "left out of the score" in stderr
    assert "Unclosed" not in stderr and "Traceback" not in stderr
    said = [line for line in stderr.splitlines() if not line.startswith("eval: ")]  # progress
    # the server's failure once, the first trajectory's cause, the count
    assert len(said) == 3 and said[0].startswith(f"{url}/v1/completions: "), stderr
    assert said[1].startswith("engine failed on q"), stderr


def test_eval_without_a_policy_is_an_error(tmp_path: Path) -> None:
    data = tmp_path / "bench.jsonl"
    data.write_text(json.dumps({"id": "a", "problem": "1+1", "answer": "2"}) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "codeloop", "eval", "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=300,  # a hang, not speed: starting Python and torch on a starved core
    )
    assert done.returncode == 2 and "--model" in done.stderr


def test_a_corrupt_line_inside_the_results_is_an_error(
    fmt: PromptFormat, scripted_run: tuple[Path, dict], tmp_path: Path
) -> None:
    out = tmp_path / "corrupt"
    shutil.copytree(scripted_run[0], out)
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text("\n".join(["{oops", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"results.jsonl:1: not JSON"):
        run_eval(fmt, out, ScriptedPolicy(fmt))


def test_an_evaluation_spread_over_two_engines(
    fmt: PromptFormat, scripted_run: tuple[Path, dict], tmp_path: Path
) -> None:
    from codeloop.engine.scheduler import Scheduler
    from codeloop.sandbox.pool import LocalSandbox

    policy = ScriptedPolicy(fmt)  # one policy behind two engines: the same samples as one
    calls: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        async def generate(self, prompt_ids: list[int], params: Any) -> Any:
            calls.append(self.name)
            await asyncio.sleep(0.01)  # calls overlap, as on servers
            return await policy.generate(prompt_ids, params)

    async def main() -> dict:
        scheduler = Scheduler([Named("a"), Named("b")], "kv_aware")
        async with LocalSandbox(cfg_for_eval().sandbox) as tools:
            return await evaluate(
                scheduler, tools, fmt, PROBLEMS, cfg=cfg_for_eval(), out_dir=tmp_path, concurrency=2
            )

    summary = asyncio.run(main())
    _, alone = scripted_run
    keys = ("pass@1", "pass@2", "maj@4", "tool_calls", "tool_error_ratio")
    assert {k: summary[k] for k in keys} == {k: alone[k] for k in keys}
    assert set(calls) == {"a", "b"}


def test_a_trained_policy_is_evaluated_as_it_was_trained(fmt: PromptFormat, tmp_path: Path) -> None:
    """A policy saved by codeloop carries its prompt format and eval settings: `codeloop eval
    --model DIR` without `--config` scores what the training config would have."""
    from codeloop.cli import main
    from codeloop.config import load_config

    demo_template = Path(__file__).resolve().parents[2] / "codeloop/recipe/demo_chat_template.jinja"
    config = tmp_path / "trained.toml"
    config.write_text(
        f'[rollout]\nchat_template = "{demo_template}"\n'
        'system_prompt = "Be brief."\nmax_tokens_per_turn = 7\n'
        "max_tool_response_chars = 300\n[eval]\ntemperature = 0.9\n"
        "max_turns = 2\nmax_response_tokens = 40\n"
    )
    cfg = load_config(config)
    trained = PromptFormat.from_config(fmt.tokenizer, cfg.rollout, cfg.eval)
    policy = tmp_path / "policy"
    tiny_model(len(fmt.tokenizer), hidden_size=32, layers=2, heads=4).save_pretrained(policy)
    trained.save_pretrained(policy)
    settings = json.loads((policy / "codeloop.json").read_text())
    assert settings["rollout"]["system_prompt"] == "Be brief."
    assert settings["eval"]["max_turns"] == 2 and settings["eval"]["temperature"] == 0.9
    assert settings["rollout"]["max_tokens_per_turn"] == 7
    assert settings["rollout"]["max_tool_response_chars"] == 300
    assert settings["trajectory"]["stop"] == ["</tool_call>"]
    assert [t["function"]["name"] for t in settings["trajectory"]["tools"]] == [
        "execute_python_code_with_standard_io"
    ]
    assert (policy / "codeloop_chat_template.jinja").read_text() == demo_template.read_text()
    data = tmp_path / "bench.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
            for p in PROBLEMS[:2]
        )
    )
    common = [
        "eval",
        "--model",
        str(policy),
        "--data",
        str(data),
        "--k",
        "2",
        "--sandbox.workers",
        "1",
    ]
    assert main([*common, "--out", str(tmp_path / "saved")]) == 0
    assert main([*common, "--config", str(config), "--out", str(tmp_path / "config")]) == 0
    assert (
        main([*common, "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "x")]) == 2
    )
    with_saved = read_jsonl(tmp_path / "saved" / "trajectories.jsonl")
    with_config = read_jsonl(tmp_path / "config" / "trajectories.jsonl")

    def by_sample(rows: list[dict]) -> list[list[int]]:  # the file is in finishing order
        return [
            t["response_ids"]
            for t in sorted(rows, key=lambda t: (t["prompt_id"], t["sample_index"]))
        ]

    assert by_sample(with_saved) == by_sample(with_config)
    prompt = trained.prompt_ids(PROBLEMS[0].problem)
    first = next(t for t in with_saved if t["prompt_id"] == PROBLEMS[0].id)  # in finishing order
    assert first["prompt_ids"] == prompt  # the demo template, not the rStar2 one
    assert all(t["num_turns"] <= 2 for t in with_saved)  # the saved eval.max_turns
    # a turn samples at most the saved 7 tokens; a random policy's first turn reaches the cap,
    # which ends its trajectory, unless it ends sooner (without the cap: up to eval's 40 tokens)
    assert max(len(t["response_ids"]) for t in with_saved) == 7
    # a command-line override comes after the saved settings
    assert main([*common, "--rollout.max_tokens_per_turn", "3", "--out", str(tmp_path / "o")]) == 0
    overridden = read_jsonl(tmp_path / "o" / "trajectories.jsonl")
    assert max(len(t["response_ids"]) for t in overridden) == 3
