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
from fractions import Fraction

from codeloop.reward import forms
from codeloop.reward.integer import (
    GLUED_COMMA,
    parse_simple,
    printed_float,
    same_number,
    terminates,
)

_DOLLARS = re.compile(r"^\$+|\$+$")
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle")
_FRAC_STYLE = re.compile(r"\\[dt]frac")
_SPACING = re.compile(r"(?<!\\)\\[,!;: ]|\\quad|\\qquad|~")
_GROUPED = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DIGIT_GROUP = re.compile(r"(?<=\d)(?:\\,|\{,\}|\\!|\\ |\u2009|\u202f)(?=\d{3}(?!\d))")
_WHOLE_TEXT = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_DECIMAL = re.compile(r"(?<![\d.])(\d*)\.(\d+)(?![\d.])")
_DIGITS, _AGREE = 60, 30  # numbers are evaluated to 60 digits and must agree in 30 of them
_PLUS_MINUS = re.compile(r"\\pm|\\mp|±|∓")
# Inline math (`$...$`, `\\(...\\)`, closed or running to the end) holding a line break: LaTeX
# and math-verify end inline math at the line, so what follows is not part of it.
_BROKEN_INLINE = re.compile(
    r"(?<![\\$])\$(?!\$)([^$]*)(?:(?<![\\$])\$(?!\$)|\Z)|\\\((.*?)(?:\\\)|\Z)", re.DOTALL
)
_SIGNED_INTERVAL = re.compile(r"(?:^|[+-])\s*[\[(][^\[\]()]*,[^\[\]()]*[\])]")


def normalise(answer: str) -> str:
    """A canonical surface form of a LaTeX answer, for the string-match check. A comma is
    followed by one space: a thousands separator is gone by then, so a comma separates."""
    text = _DOLLARS.sub("", answer.strip()).strip()
    text = GLUED_COMMA.sub(",", text).replace("\\!", "")  # `11,\! 111`; a negative space
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
    parsed = list(parse(f"${latex}$", extraction_config=extraction, parsing_timeout=None))
    if _SIGNED_INTERVAL.search(latex) and getattr(parsed[0], "is_Number", False):
        return []  # `-[0, 1)` read as 1: a misreading, not a number
    return parsed


def _rounds_to(exact: object, value: Fraction, unit: Fraction) -> bool:
    """Whether a printed float `value` (one unit of its last digit: `unit`) is `exact`, a
    sympy number with no finite decimal expansion, rounded or truncated."""
    import sympy

    if not isinstance(exact, sympy.Expr) or not exact.is_number or exact.is_real is False:
        return False
    if exact.is_Rational and terminates(Fraction(int(exact.p), int(exact.q))):
        return False  # 0.125 is written exactly
    try:
        approximation = exact.evalf(_DIGITS)
        if not approximation.is_Number:
            return False
        difference = abs(approximation - sympy.Rational(value.numerator, value.denominator))
        return bool(difference <= sympy.Rational(unit.numerator, unit.denominator))
    except (TypeError, ValueError, ArithmeticError):
        return False


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
        return same_number(pred, pred_value, gold, gold_value)
    pred_form, gold_form = normalise(pred), normalise(gold)
    if not pred_form or not gold_form:
        return False
    if pred_form == gold_form or (gold_form.isalpha() and pred_form.lower() == gold_form.lower()):
        return True
    if any("\n" in (inline[1] or inline[2] or "") for inline in _BROKEN_INLINE.finditer(pred)):
        return False  # `Answer $ \n 9 \n $`: the 9 is outside the math
    from math_verify import verify

    gold_parsed, pred_parsed = _parsed(gold), _parsed(pred)
    if not gold_parsed or not pred_parsed:
        return False
    for decimal, other in ((pred_form, gold_parsed[0]), (gold_form, pred_parsed[0])):
        printed = printed_float(decimal)
        if printed is not None:
            return _rounds_to(other, *printed)
    return bool(
        verify(gold_parsed, pred_parsed, timeout_seconds=None, allow_set_relation_comp=True)
    ) and not _apart(gold_parsed[0], pred_parsed[0])


def _apart(gold: object, pred: object) -> bool:
    """Whether two numbers math-verify called equal differ, relative to their size: it calls
    numbers equal when their difference rounds to 0 at 15 digits, so `\\frac{1}{2004!}` would
    equal `\\frac{1}{2006!}`. Numbers, and the ends of intervals and entries of tuples of the same
    shape; anything else is left to math-verify."""
    import sympy

    if isinstance(gold, sympy.Interval) and isinstance(pred, sympy.Interval):
        return _apart(gold.start, pred.start) or _apart(gold.end, pred.end)
    if isinstance(gold, sympy.Tuple) and isinstance(pred, sympy.Tuple) and len(gold) == len(pred):
        return any(_apart(g, p) for g, p in zip(gold, pred, strict=True))
    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr)):
        return False
    if not (gold.is_number and pred.is_number) or gold.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False
    try:  # each side to 60 digits on its own: `abs(gold - pred)` asks sympy for signs, slowly
        g, p = gold.evalf(_DIGITS), pred.evalf(_DIGITS)
        if not (g.is_Number and p.is_Number):
            return False
        size = max(abs(g), abs(p))
        return bool(abs(g - p) > size * sympy.Float(10) ** -_AGREE)
    except (TypeError, ValueError, ArithmeticError):
        return False
