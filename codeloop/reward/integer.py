"""The fast path: parse an answer as a plain number (an integer or a decimal) or a ratio of
two, exactly.

Accepted spellings of 1000: `1000`, `1,000`, `1{,}000`, `1\\,000`, `1 000`, `1000.0`, `+1000`,
`01000`, `$1000$`, `\\$1000`, `1000\\$`, `\\text{1000}`, `1000^\\circ`, `1000°`, `1000\\%`,
`1000 \\text{ cm}`, `1000 dollars`, `USD 1000`, `1000 \\text{ m}^2`, `1000 km/h`. There is no
tolerance: `2500`, `0.25` and `25.1` are not 25 (the released rStar2-Agent grader accepts the first
two and `103.99` for 104). A percent sign divides by 100: `25\\%` is 1/4, so it is not 25 (the
caller accepts it when the gold itself carries the percent sign). Thousands separators must group
digits by three with no space (`1,00` and `32, 349` are not integers). A decimal is read exactly
(`0.25` is 1/4, never a float); `1.5e3` is scientific notation. Anything else — fractions,
expressions — is not parsed here (`None`); the symbolic path decides.
"""

from __future__ import annotations

import re
from fractions import Fraction

_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|rm|bf)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;: ]|\\quad|\\qquad|~|\u2009|\u202f|\u00a0")
_PERCENT_WORDS = re.compile(r"\s*(?:\\text\{\s*)?(?:percent(?:age)?|pct)\}?$")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree")
_NUMBER = re.compile(
    r"(?P<sign>[+-]?)\s*"
    r"(?P<int>[1-9]\d{0,2}(?:(?:,|\{,\})\d{3})+|[1-9]\d{0,2}(?: \d{3})+|\d+)"
    r"(?:\.(?P<frac>\d+))?"
    r"(?P<rest>.*)",
    re.DOTALL,
)
_CURRENCY = re.compile(r"^(?:\\\$|\$|€|£|¥|₹|(?:USD|EUR|GBP|INR|Rs\.?)\s)\s*|\s*(?:\\\$|€|£|¥|₹)$")
_PERCENT = re.compile(r"\s*\\?%$")
_EXPONENT = re.compile(r"[eE](?P<exp>[+-]?\d+)$")
# Words of two letters or more, or one SI letter after a space; powers and one division allowed.
_UNIT = r"(?:[A-Za-z]{2,}|(?:(?<=[ /])|^)[mgsLhKVWJN](?=[²³^ /]|$))(?:\^\{?[23]\}?|[²³])?"
_UNIT_WORDS = re.compile(rf"\s*{_UNIT}(?:\s*/\s*{_UNIT}|\s+{_UNIT})*\s*")


GLUED_COMMA = re.compile(r"(?<=\d),\\!\s*(?=\d{3}(?!\d))")
_MATH_DOLLARS = re.compile(r"^\$+|(?<!\\)\$+$")  # `$...$`, not an escaped `\$` at the end


def _normalise(text: str) -> str:
    text = _MATH_DOLLARS.sub("", text.strip()).strip()
    for _ in range(3 if "\\" in text else 0):  # nested wrappers: \text{\textbf{5}}
        text = _WRAPPERS.sub(r"\1", text)
    if ",\\!" in text:  # `11,\! 111`: the comma groups thousands
        text = GLUED_COMMA.sub(",", text)
    text = _SPACES.sub(" ", text.replace("\\!", ""))  # a negative space: none at all
    text = _PERCENT_WORDS.sub("%", _DEGREES.sub("", text))
    return " ".join(text.split())


def parse_number(answer: str) -> Fraction | None:
    """The exact value `answer` spells when it is a plain number, else None."""
    if answer.isdecimal() and answer.isascii():  # the common case, ~5x faster
        return Fraction(int(answer))
    text = _normalise(answer)
    percent = _PERCENT.search(text) if "%" in text else None
    if percent:
        text = text[: percent.start()]
    if not text[:1].isdigit() or not text[-1:].isalnum():  # a sign, or currency around it
        text = _CURRENCY.sub("", text)
    match = _NUMBER.fullmatch(text)
    if match is None:
        return None
    decimals, rest, exponent = match["frac"] or "", match["rest"], None
    if rest:
        exponent = _EXPONENT.fullmatch(rest.strip())
        if exponent is None or percent or abs(int(exponent["exp"])) > 400:
            exponent = None
            if percent or not _UNIT_WORDS.fullmatch(rest):
                return None  # 12x, 5/2, 2\sqrt{3}: not a plain number
    digits = match["int"] if match["int"].isdigit() else re.sub(r"\D", "", match["int"])
    value = Fraction(int(digits + decimals), 10 ** len(decimals))
    if percent:
        value /= 100
    elif exponent:
        value *= Fraction(10) ** int(exponent["exp"])
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


_PRINTED_FLOAT = re.compile(r"[+-]?(?P<int>\d*)\.(?P<frac>\d+)")
PRINTED_DIGITS = 12  # significant digits from which a decimal reads as a printed float


def printed_float(answer: str) -> tuple[Fraction, Fraction] | None:
    """(value, one unit of its last place) of a decimal with `PRINTED_DIGITS` significant
    digits or more, the way a program prints a float (`0.0833333333333333`); else None."""
    match = _PRINTED_FLOAT.fullmatch(answer.strip().strip("$").strip())
    if match is None or len((match["int"] + match["frac"]).lstrip("0")) < PRINTED_DIGITS:
        return None
    value = parse_number(match[0])
    return (value, Fraction(1, 10 ** len(match["frac"]))) if value is not None else None


def terminates(value: Fraction) -> bool:
    """Whether `value` has a finite decimal expansion (its denominator is 2^a 5^b)."""
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    return denominator == 1


def rounds_to(exact: Fraction, answer: str) -> bool:
    """Whether `answer` is a printed float of `exact`, a value with no finite decimal expansion
    (`0.0833333333333333` for 1/12): within one unit of its last digit. An integer, or any
    value a decimal writes exactly, must be written exactly."""
    printed = printed_float(answer)
    if printed is None or terminates(exact):
        return False
    value, unit = printed
    return abs(value - exact) <= unit


def same_number(pred: str, pred_value: Fraction, gold: str, gold_value: Fraction) -> bool:
    """Equal values, or one side a printed float of the other (`integer.rounds_to`)."""
    if pred_value == gold_value:
        return True
    if len(pred) <= PRINTED_DIGITS and len(gold) <= PRINTED_DIGITS:  # too short to be one
        return False
    return rounds_to(gold_value, pred) or rounds_to(pred_value, gold)
