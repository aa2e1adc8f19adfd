"""How often the verifier agrees with labels, beside math-verify, in the same run.

Two sources of labelled (answer, gold) pairs:
- `labelled()`: the collection shipped in `labelled.jsonl`, written by hand for every family of
  docs/reward.md's table plus the answers of real `codeloop eval` trajectories
  (SmolLM2-135M-Instruct on MATH-500). A row marked `judgement` is a policy call (a percentage
  for an integer gold, degrees against radians, rounded decimals), not plain mathematics.
- `differential(seed, n)`: generated forms of the same values, equal and not equal by
  construction, each tagged with the policy that decides it. Where codeloop and math-verify
  disagree, the row's label says which is right: a disagreement where codeloop is right is a
  documented policy (its tag), one where codeloop is wrong is a bug.

math-verify's side is `verify(parse("$gold$"), parse(response))` with its defaults.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from importlib import resources
from typing import Any

from codeloop.config import RewardConfig
from codeloop.reward.integer import parse_integer
from codeloop.reward.verifier import Verifier

INTEGER_FAMILY = "integer_gold"


@dataclass(frozen=True, slots=True)
class Case:
    answer: str  # what the model boxed (may itself hold several \boxed{})
    gold: str
    label: bool  # is the answer right
    family: str  # the family of docs/reward.md's table, or the generator's policy tag
    judgement: bool = False  # a policy call rather than plain mathematics
    source: str = "hand"
    prose: bool = False  # `answer` is a whole response in prose, scored as it stands

    @property
    def response(self) -> str:
        if self.prose:
            return self.answer
        boxed = self.answer if "\\boxed" in self.answer else f"\\boxed{{{self.answer}}}"
        return f"<answer>{boxed}</answer>"

    @property
    def integer_gold(self) -> bool:
        return parse_integer(self.gold) is not None


def labelled() -> list[Case]:
    """The shipped collection (`codeloop/reward/labelled.jsonl`)."""
    text = resources.files("codeloop.reward").joinpath("labelled.jsonl").read_text("utf-8")
    cases = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        try:
            cases.append(
                Case(
                    row["answer"],
                    row["gold"],
                    row["label"],
                    row["family"],
                    row.get("judgement", False),
                    row.get("source", "hand"),
                )
            )
        except KeyError as missing:
            raise ValueError(f"labelled.jsonl line {line_number}: no field {missing}") from None
    return cases


# --- the differential generator -------------------------------------------------------------

Forms = list[tuple[str, bool, str]]  # (answer, equal to the gold, policy tag)


def _grouped(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def _integer(rng: random.Random) -> tuple[str, Forms]:
    n = rng.randint(1000, 99_999)
    head, tail = divmod(n, 1000)
    return str(n), [
        (str(n), True, "same"),
        (_grouped(n, ","), True, "thousands"),
        (_grouped(n, "{,}"), True, "thousands"),
        (_grouped(n, "\\,"), True, "thousands"),
        (f"{n}.0", True, "exact decimals"),
        (f"\\text{{{n}}}", True, "text"),
        (f"\\${n}", True, "currency and units"),
        (f"{n} \\text{{ dollars}}", True, "currency and units"),
        (f"{n} \\text{{ m}}^2", True, "currency and units"),
        (f"\\frac{{{2 * n}}}{{2}}", True, "same"),
        (f"x = {n}", True, "equations"),
        (f"\\boxed{{{n}}}, \\boxed{{{n}}}", True, "several boxed"),
        (f"{n / 1000}e3", True, "plain-text math"),
        (str(n + 1), False, "same"),
        (f"{n}\\%", False, "percent"),
        (str(n * 100), False, "same"),
        (f"{n / 100}", False, "exact decimals"),
        (f"{head}, {tail:03d}", False, "lists"),
        (f"{n - 0.01:.2f}", False, "exact decimals"),
        (f"\\boxed{{{n}}}, \\boxed{{{n + 1}}}", False, "several boxed"),
    ]


def _fraction(rng: random.Random) -> tuple[str, Forms]:
    q = rng.choice([3, 6, 7, 9, 11])
    p = rng.choice([k for k in range(1, 3 * q) if Fraction(k, q).denominator == q])
    value = Fraction(p, q)
    rounded = f"{float(value):.4f}"
    digits = f"{float(value):.12f}".split(".")[0]
    return f"\\frac{{{p}}}{{{q}}}", [
        (f"\\dfrac{{{p}}}{{{q}}}", True, "same"),
        (f"{p}/{q}", True, "same"),
        (f"\\frac{{{2 * p}}}{{{2 * q}}}", True, "same"),
        (f"{p}/({q})", True, "plain-text math"),
        (rounded, False, "exact decimals"),
        (f"-\\frac{{{p}}}{{{q}}}", False, "same"),
        (f"\\frac{{{p + 1}}}{{{q}}}", False, "same"),
        (f"{digits}.\\overline{{{_period(value)}}}", True, "repeating decimals")
        if _period(value)
        else (f"\\frac{{{p}}}{{{q}}}", True, "same"),
    ]


def _period(value: Fraction) -> str:
    """The repeating digits of a purely periodic fraction part, or '' when it is not."""
    rest, digits = value - int(value), ""
    for _ in range(12):
        rest *= 10
        digits += str(int(rest))
        rest -= int(rest)
        if rest == value - int(value):
            return digits
    return ""


def _radical(rng: random.Random) -> tuple[str, Forms]:
    a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
    return f"{a}\\sqrt{{{b}}}", [
        (f"\\sqrt{{{a * a * b}}}", True, "same"),
        (f"{a}*sqrt({b})", True, "plain-text math"),
        (f"sqrt({a * a * b})", True, "plain-text math"),
        (f"{a} \\sqrt {b}", True, "same"),
        (f"{a * b**0.5:.3f}", False, "exact decimals"),
        (f"{a}\\sqrt{{{b + 1}}}", False, "same"),
        (f"{a}*sqrt({b + 1})", False, "plain-text math"),
    ]


def _pi(rng: random.Random) -> tuple[str, Forms]:
    p, q = rng.choice([(1, 2), (1, 3), (2, 3), (3, 4), (5, 6), (1, 6)])
    return f"\\frac{{{p}\\pi}}{{{q}}}", [
        (f"\\frac{{{p}}}{{{q}}}\\pi", True, "same"),
        (f"{p}*pi/{q}", True, "plain-text math"),
        (f"{p}pi/{q}", True, "plain-text math"),
        (f"{180 * p // q}^\\circ", False, "degrees"),
        (f"{3.14159 * p / q:.4f}", False, "exact decimals"),
        (f"\\frac{{{p + 1}\\pi}}{{{q}}}", False, "same"),
    ]


def _interval(rng: random.Random) -> tuple[str, Forms]:
    a = rng.randint(-9, 3)
    b = a + rng.randint(1, 9)
    return f"[{a}, {b})", [
        (f"\\left[{a}, {b}\\right)", True, "same"),
        (f"{a} \\le x < {b}", True, "relations"),
        (f"{a} <= x < {b}", True, "relations"),
        (f"x \\in [{a}, {b})", True, "relations"),
        (f"\\{{x \\mid {a} \\leq x < {b}\\}}", True, "set-builder"),
        (f"[{a}, {b}]", False, "same"),
        (f"({a}, {b})", False, "same"),
        (f"\\{{x \\mid {a} < x < {b}\\}}", False, "set-builder"),
    ]


def _pair(rng: random.Random) -> tuple[str, Forms]:
    a, b = rng.sample(range(-9, 10), 2)
    return f"({a}, {b})", [
        (f"\\left({a},{b}\\right)", True, "same"),
        (f"\\begin{{pmatrix}} {a} \\\\ {b} \\end{{pmatrix}}", True, "matrices"),
        (f"\\begin{{bmatrix}} {a} \\\\ {b} \\end{{bmatrix}}", True, "matrices"),
        (f"\\langle {a}, {b} \\rangle", True, "matrices"),
        (f"({b}, {a})", False, "same"),
        (f"\\begin{{pmatrix}} {b} \\\\ {a} \\end{{pmatrix}}", False, "matrices"),
    ]


def _roots(rng: random.Random) -> tuple[str, Forms]:
    a, b = sorted(rng.sample(range(-9, 10), 2))
    return f"{a}, {b}", [
        (f"{b}, {a}", True, "lists"),
        (f"\\{{{a}, {b}\\}}", True, "lists"),
        (f"\\boxed{{{a}}}, \\boxed{{{b}}}", True, "several boxed"),
        (f"x = {a} \\text{{ or }} x = {b}", True, "lists"),
        (str(a), False, "lists"),
        (f"\\boxed{{{a}}}", False, "several boxed"),
        (f"{a}, {b + 1}", False, "lists"),
    ]


def _matrix(rng: random.Random) -> tuple[str, Forms]:
    a, b, c, d = rng.sample(range(-9, 10), 4)

    def m(env: str, *entries: int) -> str:
        x, y, z, w = entries
        return f"\\begin{{{env}}} {x} & {y} \\\\ {z} & {w} \\end{{{env}}}"

    return m("pmatrix", a, b, c, d), [
        (m("bmatrix", a, b, c, d), True, "matrices"),
        (
            f"\\left(\\begin{{array}}{{cc}} {a} & {b} \\\\ {c} & {d} \\end{{array}}\\right)",
            True,
            "matrices",
        ),
        (m("bmatrix", a, c, b, d), False, "matrices"),
        (m("pmatrix", a, b, c, d + 1), False, "matrices"),
    ]


def _percent(rng: random.Random) -> tuple[str, Forms]:
    p = rng.randint(1, 99)
    return f"{p}\\%", [
        (str(p), True, "percent"),
        (f"{p}%", True, "percent"),
        (f"{p / 100}", True, "percent"),
        (str(p + 1), False, "percent"),
        (f"{p / 10}", False, "percent"),
    ]


def _decimal(rng: random.Random) -> tuple[str, Forms]:
    whole, cents = rng.randint(0, 99), rng.choice([5, 25, 75, 12, 35])
    gold = f"{whole}.{cents:02d}"
    return gold, [
        (f"{whole},{cents:02d}", True, "decimal comma"),
        (f"{gold}0", True, "exact decimals"),
        (f"\\${gold}", True, "currency and units"),
        (f"{whole},{cents:02d}0", False, "decimal comma"),
        (f"{whole}.{cents + 1:02d}", False, "same"),
    ]


def _polynomial(rng: random.Random) -> tuple[str, Forms]:
    r = rng.randint(1, 9)
    return f"x^2+{2 * r}x+{r * r}", [
        (f"(x+{r})^2", True, "same"),
        (f"f(x) = (x+{r})^2", True, "function names"),
        (f"y = x^2 + {2 * r}x + {r * r}", True, "equations"),
        (f"x**2 + {2 * r}*x + {r * r}", True, "plain-text math"),
        (f"(x-{r})^2", False, "same"),
        (f"f(x) = x^2+{2 * r}x", False, "function names"),
    ]


GENERATORS: list[Callable[[random.Random], tuple[str, Forms]]] = [
    _integer,
    _fraction,
    _radical,
    _pi,
    _interval,
    _pair,
    _roots,
    _matrix,
    _percent,
    _decimal,
    _polynomial,
]


def differential(seed: int, values: int) -> list[Case]:
    """Every form of `values` generated golds (the generators taken in turn)."""
    rng = random.Random(seed)
    cases = []
    for i in range(values):
        gold, forms = GENERATORS[i % len(GENERATORS)](rng)
        cases += [
            Case(answer, gold, equal, policy, source="generated") for answer, equal, policy in forms
        ]
    return cases


# --- math-verify's own test suite ----------------------------------------------------------

_MATH_DELIMITERS = re.compile(r"\s*(\$+)(.*?)\1\s*", re.DOTALL)


_INLINE_MATH = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|\\\(.*?\\\)|\\\[.*?\\\]", re.DOTALL)
_TWO_WORDS = re.compile(r"[A-Za-z]{2,}[,:]?\s+[A-Za-z]{2,}")
# How the suite's cases are scored: prose predictions need the fallbacks (see `SuiteCase.case`).
SUITE_REWARD = RewardConfig(fallback_last_boxed=True, fallback_answer_phrase=True)


def _without_delimiters(text: str) -> str:
    """`$...$` or `$$...$$` around the whole text removed; anything else kept as it is."""
    whole = _MATH_DELIMITERS.fullmatch(text)
    return whole[2] if whole and "$" not in whole[2] else text


@dataclass(frozen=True, slots=True)
class SuiteCase:
    """One case of math-verify's tests (`math_verify_suite.json`), with the options its test
    passes to math-verify: extraction targets (None: `parse`'s defaults), rounding, strictness."""

    id: str
    gold: str
    pred: str
    expected: bool
    targets: list[str] | None
    precision: int = 6
    strict: bool = True
    allow_set_relation_comp: bool = False

    @property
    def prose(self) -> bool:
        """Whether the prediction is prose: two words in a row outside its math and no box
        (a prediction with a box is an answer block, every box of it the answer)."""
        if "\\boxed" in self.pred:
            return False
        return _TWO_WORDS.search(_INLINE_MATH.sub(" ", self.pred)) is not None

    @property
    def case(self) -> Case:
        """The case as codeloop scores it. A prediction in prose is a response without an
        answer block, read with both fallbacks on (`SUITE_REWARD`); any other is the final
        answer, boxed unless it boxes itself, without its `$` delimiters. The gold is the
        reference answer, without its `$` delimiters."""
        return Case(
            self.pred if self.prose else _without_delimiters(self.pred),
            _without_delimiters(self.gold),
            self.expected,
            self.id.split("::")[1].split("[")[0],
            source="math-verify suite",
            prose=self.prose,
        )


_PROSE = (
    "prose: the answer is inside a sentence, with no box and no answer phrase for the fallbacks "
    "to read; codeloop scores the boxed final answer (its tests cover the form itself)"
)
_WORKED = (
    "prose: a worked solution whose answer is its last result, with no box and no answer "
    "phrase; codeloop scores the boxed final answer"
)
_ROUNDED = (
    "rounding: the case asks for agreement to 2 decimals; codeloop reads decimals exactly, and "
    "only a printed float of 12 significant digits or more stands for the value it rounds"
)
# math-verify's cases codeloop does not score as the suite expects, each with why. A case listed
# here that codeloop gets right fails codeloop's test, so that the list only ever shrinks.
OUT_OF_SCOPE: dict[str, str] = {
    "test_all.py::test_number_extraction[7]": _PROSE,
    "test_all.py::test_number_extraction[13]": _PROSE,
    "test_all.py::test_number_extraction[14]": _PROSE,
    "test_all.py::test_number_extraction[15]": _PROSE,
    "test_all.py::test_number_extraction[16]": _PROSE,
    "test_all.py::test_relations_math[0]": _PROSE,
    "test_all.py::test_relations_math[1]": _PROSE,
    "test_all.py::test_relations_math[2]": _PROSE,
    "test_all.py::test_relations_math[3]": _PROSE,
    "test_all.py::test_relations_math[4]": _PROSE,
    "test_all.py::test_relations_math[7]": _PROSE,
    "test_all.py::test_matrix_extraction[1]": _PROSE,
    "test_all.py::test_matrix_extraction[2]": _PROSE,
    "test_all.py::test_matrix_extraction[3]": _PROSE,
    "test_all.py::test_matrix_extraction[4]": _PROSE,
    "test_all.py::test_matrix_extraction[5]": _PROSE,
    "test_all.py::test_matrix_extraction[6]": _PROSE,
    "test_all.py::test_math_extraction_edge_cases[0]": _WORKED,
    "test_all.py::test_math_extraction_edge_cases[1]": _WORKED,
    "test_all.py::test_math_extraction_edge_cases[2]": _WORKED,
    "test_all.py::test_math_extraction_additional_cases[8]": _WORKED,
    "test_all.py::test_math_extraction_additional_cases[1]": (
        "prose: 'Final Answer: Jane started growing Sphere 3 hours ago.' states the answer "
        "without 'is'; the phrase fallback reads 'answer is X' and 'Final Answer: ... is X'"
    ),
    "test_all.py::test_math_extraction_additional_cases[17]": (
        "boxes of intermediate results (200, 255) and the answer after them in prose; codeloop "
        "reads every box of an answer as the answer"
    ),
    "test_all.py::test_math_extraction_edge_cases[13]": (
        "percent: the gold is a worked solution boxing 20 ('\\boxed{20} percent') and the "
        "answer is 20\\%; codeloop's policy: a percentage for an integer gold is wrong"
    ),
    "test_all.py::test_complex_math_expressions[7]": _ROUNDED,
    "test_all.py::test_complex_math_expressions[13]": _ROUNDED,
    "test_all.py::test_set_rel_assymetry[3]": (
        "an option: the case turns math-verify's set/relation comparison off; codeloop always "
        "compares a relation with the set it describes (the case with it on passes)"
    ),
    "test_open_thoughts.py::test_open_thoughts[28]": (
        "a gold of two boxes with prose between: codeloop reads several boxes as one list, in a "
        "gold as in an answer; math-verify reads the last"
    ),
    "test_strict.py::test_strict_variable_comparison[1]": (
        "an option: the case turns strict variable comparison off; codeloop compares variables "
        "strictly, f(x) is not f(y) (the strict case passes)"
    ),
}


def math_verify_suite() -> tuple[list[SuiteCase], dict[str, str]]:
    """The cases of math-verify's tests, and the document's source fields (commit, notice)."""
    text = resources.files("codeloop.reward").joinpath("math_verify_suite.json").read_text("utf-8")
    document = json.loads(text)
    cases = [SuiteCase(**row) for row in document.pop("cases")]
    return cases, document


def math_verify_suite_verdicts(cases: Sequence[SuiteCase]) -> list[bool]:
    """math-verify on the raw cases, with the options each of its tests passes."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    configs: dict[str, Any] = {
        "latex": LatexExtractionConfig(boxed_match_priority=0),
        "expr": ExprExtractionConfig(),
    }
    verdicts = []
    for c in cases:
        if c.targets is None:
            gold, pred = parse(c.gold), parse(c.pred)
        else:
            targets = [configs[name] for name in c.targets]
            gold, pred = parse(c.gold, targets), parse(c.pred, targets)
        verdicts.append(
            bool(
                verify(
                    gold,
                    pred,
                    float_rounding=c.precision,
                    strict=c.strict,
                    allow_set_relation_comp=c.allow_set_relation_comp,
                )
            )
        )
    return verdicts


# --- comparison -----------------------------------------------------------------------------


def math_verify_verdicts(cases: Sequence[Case]) -> list[bool]:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return [bool(verify(parse(f"${c.gold}$"), parse(c.response))) for c in cases]


def our_verdicts(verifier: Verifier, cases: Sequence[Case]) -> list[bool]:
    results = verifier.score_batch([(c.response, c.gold) for c in cases])
    return [r.reward == 1.0 for r in results]


def summary(cases: Sequence[Case], ours: Sequence[bool], theirs: Sequence[bool]) -> dict[str, Any]:
    """Agreement with the labels for both sides, overall and without judgement calls; wrong
    answers accepted on integer golds; disagreements between the two sides by family."""
    rows = list(zip(cases, ours, theirs, strict=True))
    plain = [(c, o, t) for c, o, t in rows if not c.judgement]

    def rate(part: list[tuple[Case, bool, bool]], side: int) -> float:
        return sum((o, t)[side - 1] == c.label for c, o, t in part) / max(len(part), 1)

    def accepted_wrong(side: int) -> int:
        return sum((o, t)[side - 1] and not c.label and c.integer_gold for c, o, t in rows)

    policy = Counter(c.family for c, o, t in rows if o != t and o == c.label)
    bugs = [c for c, o, t in rows if o != c.label]
    return {
        "cases": len(rows),
        "judgement_calls": len(rows) - len(plain),
        "ours_agree": rate(rows, 1),
        "math_verify_agree": rate(rows, 2),
        "ours_agree_plain": rate(plain, 1),
        "math_verify_agree_plain": rate(plain, 2),
        "ours_accepted_wrong_integer": accepted_wrong(1),
        "math_verify_accepted_wrong_integer": accepted_wrong(2),
        "disagreements": sum(o != t for _, o, t in rows),
        "disagreements_by_policy": dict(policy.most_common()),
        "ours_wrong": [
            {"answer": c.answer, "gold": c.gold, "label": c.label, "family": c.family} for c in bugs
        ],
    }
