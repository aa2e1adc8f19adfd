"""`codeloop bench reward`: the verifier against plain math-verify on the same labelled cases.

Case sets, generated from a seed with known labels: `integer` (integer golds, answers spelled
in the ways models write them, traps such as 2500 or 0.25 for 25), `latex` (fractions,
decimals, radicals, pi, intervals, sets, tuples, equations, `\\pm`), and `mix` (70% integer,
30% LaTeX). Each response is a full trajectory text with a tool response holding a decoy
`\\boxed{}`. Our side: `Verifier.score_batch` (the integer set on one core in the caller; the
others with 1 and with N workers). The baseline, in the same run: `verify(parse(gold),
parse(response))` with math-verify's defaults, one call after another. Pathological answers run
once each, ours under the deadline and the baseline in a subprocess with an outer limit.
Prints items/s, ratios, and how often each side agrees with the labels; writes JSON.

Agreement (`agreement.py`), both sides in the same run: the shipped labelled collection (hand
cases for every family of docs/reward.md's table and answers of real `codeloop eval`
trajectories) by family, with and without judgement calls, and wrong answers accepted on integer
golds; then the differential harness, generated equal and unequal forms whose disagreements with
math-verify are counted by the policy that decides them (codeloop wrong on one is a bug).

`--against math-verify` runs only the agreement: both verifiers on the labelled collection, the
answers a policy sampled, math-verify's own test suite (`codeloop/reward/math_verify_suite.json`,
each case with the options its test passes to math-verify) and the generated forms; it prints
every case where they disagree, who is right by the label, and the counts by kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from codeloop.config import RewardConfig
from codeloop.helpformat import HelpFormatter
from codeloop.reward import agreement
from codeloop.reward.verifier import Verifier
from codeloop.reward.workers import default_workers

Case = tuple[str, str, bool]  # (response text, gold, is the response correct)

PATHOLOGICAL = [
    r"\dfrac{5^{(5^{(5^{(5^5)})} - 4)} - 5}{16}",
    r"10^{10^{10^{10}}}",
    r"2^{2^{32}}-1",
    r"(10^{100000})!",
]


def _response(answer: str, rng: random.Random) -> str:
    decoy = rng.randint(0, 10**6)
    return (
        "<reason>Let me compute it with code.</reason>\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(...)"}}\n</tool_call>\n'
        f"<tool_response>\\boxed{{{decoy}}}</tool_response>\n"
        f"<answer>So the final answer is $\\boxed{{{answer}}}$.</answer>"
    )


def _spell(value: int, rng: random.Random) -> str:
    spellings = [
        str(value),
        f"{value:,}",
        f"{value:,}".replace(",", "{,}"),
        f"\\text{{{value}}}",
        f"{value}.0",
        f"{value}^\\circ",
        f"{value} \\text{{ cm}}",
    ]
    return rng.choice(spellings)


def integer_cases(n: int, rng: random.Random) -> list[Case]:
    cases = []
    for _ in range(n):
        gold = rng.randint(1, 99_999)
        kind = rng.random()
        if kind < 0.5:
            pred, ok = _spell(gold, rng), True
        elif kind < 0.8:
            pred, ok = _spell(gold + rng.choice([-2, -1, 1, 2, 10]), rng), False
        else:  # the traps of a tolerant or percentage-aware grader
            pred, ok = rng.choice([f"{gold * 100}", f"{gold / 100}", f"{gold - 0.01:.2f}"]), False
        cases.append((_response(pred, rng), str(gold), ok))
    return cases


def _latex_case(rng: random.Random) -> tuple[str, str, bool]:
    b = rng.choice([3, 7, 9, 11, 13])
    a = rng.choice([n for n in range(1, 41) if n % b])  # a/b is never an integer
    c, d = rng.choice([2, 4, 5, 8]), rng.randint(2, 30)
    templates: list[tuple[str, list[tuple[str, bool]]]] = [
        (
            f"\\frac{{{a}}}{{{b}}}",
            [
                (f"\\dfrac{{{2 * a}}}{{{2 * b}}}", True),
                (f"{a / b:.4f}", False),
                (f"\\frac{{{a + 1}}}{{{b}}}", False),
            ],
        ),
        (f"\\frac{{{a}}}{{{c}}}", [(f"{a / c}", True), (f"\\frac{{{a}}}{{{c + 1}}}", False)]),
        (f"{a}\\sqrt{{{b}}}", [(f"\\sqrt{{{a * a * b}}}", True), (f"{a}\\sqrt{{{b + 1}}}", False)]),
        (
            f"\\frac{{{a}\\pi}}{{{b}}}",
            [(f"\\frac{{{a}}}{{{b}}}\\pi", True), (f"{a * 3.14159 / b:.3f}", False)],
        ),
        (f"[{a}, {a + d})", [(f"\\left[{a},{a + d}\\right)", True), (f"[{a}, {a + d}]", False)]),
        (
            f"\\{{{a}, {a + d}\\}}",
            [(f"\\{{{a + d}, {a}\\}}", True), (f"\\{{{a}, {a + d + 1}\\}}", False)],
        ),
        (f"({a}, {a + d})", [(f"({a},{a + d})", True), (f"({a + d}, {a})", False)]),
        (f"x = \\frac{{{a}}}{{{b}}}", [(f"\\frac{{{a}}}{{{b}}}", True), (f"x = {a}", False)]),
        (
            f"{a} \\pm \\sqrt{{{b}}}",
            [(f"{a} + \\sqrt{{{b}}}, {a} - \\sqrt{{{b}}}", True), (f"{a} + \\sqrt{{{b}}}", False)],
        ),
    ]
    gold, preds = rng.choice(templates)
    pred, ok = rng.choice(preds)
    return pred, gold, ok


def latex_cases(n: int, rng: random.Random) -> list[Case]:
    cases = []
    for _ in range(n):
        pred, gold, ok = _latex_case(rng)
        cases.append((_response(pred, rng), gold, ok))
    return cases


def _ours(verifier: Verifier, cases: list[Case]) -> tuple[float, float]:
    start = time.perf_counter()
    results = verifier.score_batch([(text, gold) for text, gold, _ in cases])
    seconds = time.perf_counter() - start
    agree = sum((r.reward == 1.0) == ok for r, (_, _, ok) in zip(results, cases, strict=True))
    return len(cases) / seconds, agree / len(cases)


def _math_verify(cases: list[Case]) -> tuple[float, float]:
    from math_verify import parse, verify

    start = time.perf_counter()
    agree = sum(bool(verify(parse(gold), parse(text))) == ok for text, gold, ok in cases)
    return len(cases) / (time.perf_counter() - start), agree / len(cases)


def _medians(verifier: Verifier, cases: list[Case]) -> dict[str, float]:
    """The median time of one pair, scored alone, on each side (ours: the call as a caller
    sees it, worker round trip included)."""
    from math_verify import parse, verify

    ours, theirs = [], []
    for text, gold, _ in cases:
        start = time.perf_counter()
        verifier.score(text, gold)
        middle = time.perf_counter()
        verify(parse(gold), parse(text))
        theirs.append(time.perf_counter() - middle)
        ours.append(middle - start)
    return {"ours_s": statistics.median(ours), "math_verify_s": statistics.median(theirs)}


def _baseline_one(answer: str, limit_s: float) -> float | None:
    code = (
        "import sys; from math_verify import parse, verify\n"
        "verify(parse('$25$'), parse(sys.argv[1]))\n"
    )
    start = time.perf_counter()
    try:
        subprocess.run(
            [sys.executable, "-c", code, f"\\boxed{{{answer}}}"],
            timeout=limit_s,
            capture_output=True,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - start


def _row(name: str, ours: tuple[float, float], base: tuple[float, float]) -> dict[str, Any]:
    row = {
        "set": name,
        "ours_per_s": ours[0],
        "ours_agree": ours[1],
        "ratio": ours[0] / base[0],
        "math_verify_per_s": base[0],
        "math_verify_agree": base[1],
    }
    print(
        f"{name:22} {ours[0]:>10.0f} {base[0]:>10.1f} {row['ratio']:>8.1f}x "
        f"{100 * ours[1]:>7.1f}% {100 * base[1]:>7.1f}%"
    )
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    ints, latex = integer_cases(args.n, rng), latex_cases(args.n_latex, rng)
    mix = rng.sample(ints, int(0.7 * args.n_latex)) + latex[: int(0.3 * args.n_latex)]
    rng.shuffle(mix)
    base_n = args.baseline_n
    print(f"{'set':22} {'ours/s':>10} {'m-v/s':>10} {'ratio':>9} {'ours ok':>8} {'m-v ok':>8}")
    rows = []
    with Verifier(RewardConfig(workers=1, deadline_s=args.deadline_s)) as one:
        rows.append(_row("integer, 1 core", _ours(one, ints), _math_verify(ints[:base_n])))
        one.score("<answer>\\boxed{\\frac12}</answer>", "0.5")  # start the worker
        latex_base = _math_verify(latex[:base_n])
        rows.append(_row("latex, 1 worker", _ours(one, latex), latex_base))
        medians = _medians(one, latex[:base_n])
    workers = args.workers or default_workers()
    with Verifier(RewardConfig(workers=workers, deadline_s=args.deadline_s)) as many:
        many.score("<answer>\\boxed{\\frac12}</answer>", "0.5")
        rows.append(_row(f"latex, {workers} workers", _ours(many, latex), latex_base))
        rows.append(_row(f"mix, {workers} workers", _ours(many, mix), _math_verify(mix[:base_n])))
        patho = _pathological(many, args.deadline_s, args.baseline_limit_s, args.pathological)
        collection = _labelled(many)
        generated = _differential(many, args.seed, args.differential_values)
    print(
        f"\nlatex, one pair at a time: median ours {1e3 * medians['ours_s']:.2f} ms, "
        f"math-verify {1e3 * medians['math_verify_s']:.2f} ms "
        f"({medians['math_verify_s'] / medians['ours_s']:.1f}x)"
    )
    return {
        "sets": rows,
        "latex_median": medians,
        "pathological": patho,
        "labelled": collection,
        "differential": generated,
        "workers": workers,
        "seed": args.seed,
    }


def _labelled(verifier: Verifier) -> dict[str, Any]:
    cases = agreement.labelled()
    ours = agreement.our_verdicts(verifier, cases)
    theirs = agreement.math_verify_verdicts(cases)
    report = agreement.summary(cases, ours, theirs)
    print(
        f"\nlabelled collection: {report['cases']} cases, {report['judgement_calls']} judgement "
        f"calls\n{'family':22} {'cases':>6} {'ours ok':>8} {'m-v ok':>8}"
    )
    families: dict[str, list[int]] = {}
    for case, o, t in zip(cases, ours, theirs, strict=True):
        counts = families.setdefault(case.family, [0, 0, 0])
        counts[0] += 1
        counts[1] += o == case.label
        counts[2] += t == case.label
    for family, (n, o_ok, t_ok) in families.items():
        print(f"{family:22} {n:>6} {100 * o_ok / n:>7.1f}% {100 * t_ok / n:>7.1f}%")
    print(
        f"{'all':22} {len(cases):>6} {100 * report['ours_agree']:>7.1f}% "
        f"{100 * report['math_verify_agree']:>7.1f}%\n"
        f"{'no judgement calls':22} {len(cases) - report['judgement_calls']:>6} "
        f"{100 * report['ours_agree_plain']:>7.1f}% "
        f"{100 * report['math_verify_agree_plain']:>7.1f}%\n"
        f"wrong answers accepted on integer golds: ours {report['ours_accepted_wrong_integer']}, "
        f"math-verify {report['math_verify_accepted_wrong_integer']}"
    )
    for row in report["ours_wrong"]:
        print(f"  ours wrong: {row}")
    return report


def _differential(verifier: Verifier, seed: int, values: int) -> dict[str, Any]:
    cases = agreement.differential(seed, values)
    report = agreement.summary(
        cases, agreement.our_verdicts(verifier, cases), agreement.math_verify_verdicts(cases)
    )
    by_policy = ", ".join(f"{k} {v}" for k, v in report["disagreements_by_policy"].items())
    print(
        f"\ndifferential: {len(cases)} generated forms of {values} golds; disagreements with "
        f"math-verify {report['disagreements']} ({by_policy}); codeloop wrong (bugs) "
        f"{len(report['ours_wrong'])}"
    )
    for row in report["ours_wrong"][:20]:
        print(f"  bug: {row}")
    return report


def _pathological(
    verifier: Verifier, deadline_s: float, limit_s: float, count: int
) -> list[dict[str, Any]]:
    print(
        f"\npathological (deadline {deadline_s} s; math-verify in a subprocess, limit {limit_s} s)"
    )
    rows = []
    for answer in PATHOLOGICAL[:count]:
        start = time.perf_counter()
        result = verifier.score(f"<answer>\\boxed{{{answer}}}</answer>", "25")
        ours_s = time.perf_counter() - start
        base_s = _baseline_one(answer, limit_s)
        shown = f"{base_s:.2f} s" if base_s is not None else f"> {limit_s:.0f} s (killed)"
        print(f"  {answer:45} ours {ours_s:.2f} s ({result.reason})   math-verify {shown}")
        rows.append(
            {
                "answer": answer,
                "ours_s": ours_s,
                "ours_reason": str(result.reason),
                "math_verify_s": base_s,
            }
        )
    return rows


def against_math_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Both verifiers on every labelled set: the shipped collection (hand cases, and answers
    sampled from a policy), math-verify's own suite and the generated forms. Prints each set's
    agreement with its labels and every case where the two disagree, counted by kind."""
    collection = agreement.labelled()
    suite, document = agreement.math_verify_suite()
    sets: list[tuple[str, list[agreement.Case], list[bool]]] = []
    hand = [c for c in collection if not c.source.startswith("codeloop eval")]
    sampled = [c for c in collection if c.source.startswith("codeloop eval")]
    generated = agreement.differential(args.seed, args.differential_values)
    for name, cases in (("labelled", hand), ("policy samples", sampled), ("generated", generated)):
        sets.append((name, cases, agreement.math_verify_verdicts(cases)))
    suite_name = f"math-verify suite ({document['commit'][:7]})"
    sets.append((suite_name, [c.case for c in suite], agreement.math_verify_suite_verdicts(suite)))
    cfg = dataclasses.replace(
        agreement.SUITE_REWARD,
        workers=args.workers or default_workers(),
        deadline_s=args.deadline_s,
    )
    report: dict[str, Any] = {"sets": [], "out_of_scope": agreement.OUT_OF_SCOPE}
    print(f"{'set':26} {'cases':>6} {'ours ok':>8} {'m-v ok':>8} {'disagree':>9}")
    verdicts: dict[str, list[bool]] = {}
    with Verifier(cfg) as verifier:
        for name, cases, theirs in sets:
            verdicts[name] = agreement.our_verdicts(verifier, cases)
            report["sets"].append(_disagreements(name, cases, verdicts[name], theirs))
    scoped = [
        ok == c.expected
        for c, ok in zip(suite, verdicts[suite_name], strict=True)
        if c.id not in agreement.OUT_OF_SCOPE
    ]
    report["suite_in_scope"] = {"cases": len(scoped), "passed": sum(scoped)}
    print(
        f"{suite_name}: {sum(scoped)} of the {len(scoped)} cases in scope pass; "
        f"{len(suite) - len(scoped)} out of scope (agreement.OUT_OF_SCOPE: why, case by case)"
    )
    for row in report["sets"]:
        if row["disagreements"]:
            kinds = ", ".join(f"{k} {n}" for k, n in row["by_kind"].items())
            print(f"\n{row['set']}: {len(row['disagreements'])} disagreements ({kinds})")
            shown: Counter[str] = Counter()
            for case in row["disagreements"]:
                shown[case["kind"]] += 1
                if shown[case["kind"]] > args.show:
                    continue
                right = "ours" if case["ours_right"] else "m-v"
                print(
                    f"  {_short(case['kind'], 24):24} right: {right:4}"
                    f"  {_short(case['answer']):44} gold {_short(case['gold'], 30)}"
                )
            hidden = sum(max(n - args.show, 0) for n in shown.values())
            if hidden:
                print(f"  ... and {hidden} more of the same kinds (all in the JSON report)")
    return report


def _disagreements(
    name: str, cases: list[agreement.Case], ours: list[bool], theirs: list[bool]
) -> dict[str, Any]:
    rows = list(zip(cases, ours, theirs, strict=True))
    differ = [
        {
            "kind": c.family,
            "answer": c.answer,
            "gold": c.gold,
            "label": c.label,
            "ours": o,
            "math_verify": t,
            "ours_right": o == c.label,
        }
        for c, o, t in rows
        if o != t
    ]
    ours_agree = sum(o == c.label for c, o, _ in rows) / max(len(rows), 1)
    theirs_agree = sum(t == c.label for c, _, t in rows) / max(len(rows), 1)
    row: dict[str, Any] = {
        "set": name,
        "cases": len(rows),
        "ours_agree": ours_agree,
        "math_verify_agree": theirs_agree,
        "by_kind": dict(Counter(d["kind"] for d in differ).most_common()),
        "disagreements": differ,
    }
    print(
        f"{name:26} {len(rows):>6} {100 * ours_agree:>7.1f}% "
        f"{100 * theirs_agree:>7.1f}% {len(differ):>9}"
    )
    return row


def _short(text: str, width: int = 44) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="codeloop bench reward",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--n", type=int, default=50_000, help="integer cases")
    parser.add_argument("--n-latex", type=int, default=2_000, help="LaTeX cases (and mix size)")
    parser.add_argument("--baseline-n", type=int, default=1_000, help="cases math-verify runs")
    parser.add_argument("--workers", type=int, default=0, help="0 = one per core")
    parser.add_argument(
        "--deadline-s", type=float, default=5.0, help="the verifier's deadline per item, seconds"
    )
    parser.add_argument(
        "--baseline-limit-s",
        type=float,
        default=30.0,
        help="math-verify's limit per pathological item, seconds",
    )
    parser.add_argument("--pathological", type=int, default=len(PATHOLOGICAL), help="how many")
    parser.add_argument(
        "--differential-values",
        type=int,
        default=440,
        help="golds the differential harness generates forms of",
    )
    parser.add_argument("--seed", type=int, default=0, help="case generator seed")
    parser.add_argument("--out", default="bench-results/reward.json", help="JSON report")
    parser.add_argument(
        "--against",
        choices=["math-verify"],
        help="only the agreement report: both verifiers on the labelled collection, the "
        "policy's sampled answers, math-verify's own suite and the generated forms, with every "
        "disagreement and its kind",
    )
    parser.add_argument(
        "--show", type=int, default=3, help="with --against: disagreements printed per kind"
    )
    args = parser.parse_args(argv)
    report = against_math_verify(args) if args.against else run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0
