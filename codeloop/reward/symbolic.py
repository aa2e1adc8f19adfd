"""Equivalence of a predicted answer and a gold answer that is not a plain integer.

Pure but possibly slow (sympy can hang in C-level big-integer work), so `codeloop.reward`
runs `equivalent` only in killable worker processes with a deadline (see `workers.py`).

Order of checks:
1. Normalised string match (`\\dfrac`→`\\frac`, `\\left`/`\\right`, spacing, `$`, `\\text{}`
   around a whole answer, a trailing period, case for text answers).
2. `\\pm`/`\\mp` expand into the two answers they stand for, so `\\frac{-1\\pm\\sqrt{17}}{2}`
   equals the two roots listed in any order.
3. math-verify's parser and comparison, with the gold wrapped in `$...$` so that a bare LaTeX
   gold parses, and with every decimal literal rewritten as an exact fraction first, so that
   numbers compare exactly: `0.25` is `\\frac{1}{4}`, `0.333` is not `\\frac13`, `103.99` is
   not 104. Digit groups (`3\\,375`, `3{,}375`) are joined before parsing.

Order rules (math-verify's): `\\{a, b\\}` and a bare list `a, b` (several answers) are
unordered; a tuple `(a, b)` is ordered; `(a, b)` and `[a, b)` are also read as intervals, whose
ends must match exactly, open or closed; an inequality equals the interval it describes
(`x \\le 3` is `(-\\infty, 3]`). `x = 5` equals `5`, but `x = 5` does not equal `y = 5`.
A percent sign divides by 100, as on the integer path: `50\\%` is `\\frac12`, not 50 (but a
gold written `50\\%` accepts a bare 50: `forms.other_readings`). Before all this, the families
of `forms.py` (matrices, relations, plain-text math, function names, several boxed answers,
repeating decimals) are brought to one form.
"""

from __future__ import annotations

import re

from codeloop.reward import forms
from codeloop.reward.integer import parse_simple

_DOLLARS = re.compile(r"^\$+|\$+$")
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle")
_FRAC_STYLE = re.compile(r"\\[dt]frac")
_SPACING = re.compile(r"(?<!\\)\\[,!;: ]|\\quad|\\qquad|~")
_GROUPED = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:\\,|\{,\}|\\!|\\ |\u2009|\u202f)(?=\d{3}(?!\d))")
_WHOLE_TEXT = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d+)(?![\d.])")
_PLUS_MINUS = re.compile(r"\\pm|\\mp|±|∓")


def normalise(answer: str) -> str:
    """A canonical surface form of a LaTeX answer, for the string-match check. A comma is
    followed by one space: a thousands separator is gone by then, so a comma separates."""
    text = _DOLLARS.sub("", answer.strip()).strip().replace("\\!", "")  # negative space
    text = _DIGIT_GROUP.sub("", text)
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    text = _SIZING.sub("", text)
    text = _FRAC_STYLE.sub(r"\\frac", text)
    text = _SPACING.sub(" ", text)
    text = re.sub(r"(?<!\\)%", r"\\%", text).rstrip(".").strip()
    whole = _WHOLE_TEXT.match(text)
    if whole:
        text = whole.group(1).strip()
    text = forms.rewrite(text)
    return "".join(text.split()).replace(",", ", ")


def _exact_decimals(latex: str) -> str:
    """Every decimal literal as an exact fraction: `0.25` -> `\\frac{025}{100}`."""

    def fraction(match: re.Match[str]) -> str:
        whole, decimals = match.group(1), match.group(2)
        return f"\\frac{{{whole}{decimals}}}{{1{'0' * len(decimals)}}}"

    return _DECIMAL.sub(fraction, latex)


def _expand_plus_minus(latex: str) -> str:
    """`a \\pm b` -> `a + b, a - b` (the first sign only; nested signs are rare)."""
    match = _PLUS_MINUS.search(latex)
    if match is None:
        return latex
    head, tail = latex[: match.start()], latex[match.end() :]
    minus_first = match.group(0) in ("\\mp", "∓")
    first, second = ("-", "+") if minus_first else ("+", "-")
    return f"{head}{first}{tail}, {head}{second}{tail}"


def _parsed(answer: str) -> list[object]:
    # Imported here: the fast path in the caller uses `normalise` and must not pay for sympy.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    latex = _exact_decimals(_expand_plus_minus(normalise(answer)))
    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return list(parse(f"${latex}$", extraction_config=extraction, parsing_timeout=None))


def equivalent(pred: str, gold: str) -> bool:
    """Whether `pred` states the same answer as `gold` (see the module docstring), in any of
    the readings of `forms.other_readings` (percent, decimal comma)."""
    if forms.percent_for_integer(pred, gold):
        return False
    pairs = [(pred, gold), *forms.other_readings(pred, gold)]
    return any(_equivalent(other_pred, other_gold) for other_pred, other_gold in pairs)


def _equivalent(pred: str, gold: str) -> bool:
    pred_value, gold_value = parse_simple(pred), parse_simple(gold)
    if pred_value is not None and gold_value is not None:  # numbers with units, currency
        return pred_value == gold_value
    pred_form, gold_form = normalise(pred), normalise(gold)
    if not pred_form or not gold_form:
        return False
    if pred_form == gold_form or (gold_form.isalpha() and pred_form.lower() == gold_form.lower()):
        return True
    from math_verify import verify

    gold_parsed, pred_parsed = _parsed(gold), _parsed(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(
        verify(gold_parsed, pred_parsed, timeout_seconds=None, allow_set_relation_comp=True)
    )
