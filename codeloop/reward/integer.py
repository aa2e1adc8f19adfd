"""The fast path: parse an answer as a plain number (an integer or a decimal) or a ratio of
two, exactly.

Accepted spellings of 1000: `1000`, `1,000`, `1{,}000`, `1\\,000`, `1 000`, `1000.0`, `+1000`,
`01000`, `$1000$`, `\\text{1000}`, `1000^\\circ`, `1000°`, `1000\\%`, `1000 \\text{ cm}`,
`1000 dollars`. There is no tolerance and no percentage rule: `2500`, `0.25` and `25.1` are not
25 (the released rStar2-Agent grader accepts the first two and `103.99` for 104). Thousands
separators must group digits by three (`1,00` is not an integer). A decimal is read exactly
(`0.25` is 1/4, never a float). Anything else — fractions, expressions, scientific notation —
is not parsed here (`None`); the symbolic path decides.
"""

from __future__ import annotations

import re
from fractions import Fraction

_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|rm|bf)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,!;: ]|\\quad|\\qquad|~|\u2009|\u202f|\u00a0")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree")
_NUMBER = re.compile(
    r"(?P<sign>[+-]?)\s*"
    r"(?P<int>\d{1,3}(?:(?:,|\{,\})\d{3})+|\d{1,3}(?: \d{3})+|\d+)"
    r"(?:\.(?P<frac>\d+))?"
    r"(?P<rest>.*)",
    re.DOTALL,
)
_UNIT_WORDS = re.compile(r"[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})*")


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    for _ in range(3 if "\\" in text else 0):  # nested wrappers: \text{\textbf{5}}
        text = _WRAPPERS.sub(r"\1", text)
    text = _SPACES.sub(" ", text)
    text = _DEGREES.sub("", text)
    text = text.replace("\\%", "").replace("%", "").replace("\\$", "")
    return " ".join(text.split())


def parse_number(answer: str) -> Fraction | None:
    """The exact value `answer` spells when it is a plain number, else None."""
    if answer.isdecimal() and answer.isascii():  # the common case, ~5x faster
        return Fraction(int(answer))
    match = _NUMBER.fullmatch(_normalise(answer))
    if match is None:
        return None
    rest = match["rest"].strip()
    if rest and not _UNIT_WORDS.fullmatch(rest):
        return None  # 12x, 5/2, 3e4, 2\sqrt{3}: not a plain number
    decimals = match["frac"] or ""
    value = Fraction(int(re.sub(r"\D", "", match["int"]) + decimals), 10 ** len(decimals))
    return -value if match["sign"] == "-" else value


def parse_integer(answer: str) -> int | None:
    """The integer `answer` spells (`1000.0` included), or None when it is not plainly one."""
    value = parse_number(answer)
    return int(value) if value is not None and value.denominator == 1 else None


_RATIO = re.compile(
    r"(?P<sign>[+-]?)\s*(?:\\[dt]?frac\s*\{(?P<num>[^{}]+)\}\s*\{(?P<den>[^{}]+)\}"
    r"|\\[dt]?frac(?P<num1>\d)(?P<den1>\d)|(?P<num2>[^/]+)/(?P<den2>[^/]+))"
)


def parse_simple(answer: str) -> Fraction | None:
    """The exact value of a plain number or a ratio of two (`\\frac{3}{4}`, `-3/4`), else None."""
    value = parse_number(answer)
    if value is not None:
        return value
    match = _RATIO.fullmatch(answer.strip().strip("$").strip())
    if match is None:
        return None
    num = parse_number(match["num"] or match["num1"] or match["num2"])
    den = parse_number(match["den"] or match["den1"] or match["den2"])
    if num is None or den is None or den == 0:
        return None
    return -num / den if match["sign"] == "-" else num / den
