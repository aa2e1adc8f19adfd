"""Rewrites that bring the ways an answer is written to one form before it is compared.

Each rewrite is one family of spellings; docs/reward.md states the policies.
- Several boxed answers inside one answer (`\\boxed{(1, 2)}, \\boxed{(2, 1)}`) -> the list
  `(1, 2), (2, 1)`; the same value boxed twice is one answer.
- `\\sqrt(2)` -> `\\sqrt{2}` (math-verify reads `4\\sqrt(2)` as 4).
- A power of 1, `1^{...}`, -> `1` (its exponent is not evaluated: `1^{(2^{235423523})}` would
  cost seconds of big-integer arithmetic), unless the exponent holds an infinity.
- Plain-text math, when the answer has no backslash: `pi/2`, `sqrt(17)`, `exp(16)`, `2**3`,
  `-2*pi`, `2^(1/3)`, `inf`, `1.5e3` (scientific notation, not 1.5 times Euler's e^3) -> LaTeX.
- Relations: `>=`, `≥`, `\\ge`, `\\geqslant` -> `\\geq`; `\\leq` and `\\neq` likewise.
- Set-builder notation `\\{x \\mid P\\}` (or `:`, `|`) -> the condition P, which math-verify
  reads as the interval it describes.
- Matrices: `bmatrix`, `Bmatrix`, `matrix`, `smallmatrix` and `array` (its column spec dropped),
  bracketed or not, -> `pmatrix`; a matrix of one row or one column, and `\\langle a, b
  \\rangle`, -> the tuple `(a, b)`. `vmatrix` is a determinant and is left alone.
- A function's or a vector's name: `f(x) = x + 1` -> `x + 1`, `\\mathbf{v} = (1, 2)` -> `(1, 2)`.
- Synonyms: `\\varnothing` is `\\emptyset`; `\\mathbb{R}` and "all real numbers" are
  `(-\\infty, \\infty)`.
- A repeating decimal: `0.1\\overline{6}` -> `\\frac{15}{90}`.

Pure string work, no sympy: the fast path in the caller uses it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from codeloop.reward.extract import boxed_list
from codeloop.reward.integer import parse_integer

_MATRIX_BEGIN = re.compile(r"\\begin\{(?:[bB]?matrix|smallmatrix|array\}\{[^{}]*)\}")
_MATRIX_END = re.compile(r"\\end\{(?:[bB]?matrix|smallmatrix|array)\}")
_ONE_MATRIX = re.compile(r"^[(\[]?\s*\\begin\{pmatrix\}(.*?)\\end\{pmatrix\}\s*[)\]]?$", re.DOTALL)
_RELATIONS = [
    (re.compile(r">=|≥|\\geqslant|\\ge(?![a-zA-Z])"), r"\\geq "),
    (re.compile(r"<=|≤|\\leqslant|\\le(?![a-zA-Z])"), r"\\leq "),
    (re.compile(r"!=|≠|\\ne(?![a-zA-Z])"), r"\\neq "),
]
_SET_BUILDER = re.compile(
    r"^\\\{\s*[A-Za-z](?:\s*\\in\s*\\mathbb\{R\})?\s*(?:\\mid|\||:|\\colon)\s*(.+?)\s*\\\}$",
    re.DOTALL,
)
_FUNCTION_NAME = re.compile(
    r"^\s*[A-Za-z](?:_\{?\w+\}?)?\s*\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\)\s*=(?!=)\s*"
)
_SCIENTIFIC = re.compile(r"(?<![A-Za-z\d.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\d.])")
_VECTOR_NAME = re.compile(
    r"^\s*\\(?:mathbf|vec|bf|boldsymbol|overrightarrow)\s*\{\w*\}\s*=(?!=)\s*"
)
_REPEATING = re.compile(r"(\d*)\.(\d*)\\overline\s*\{(\d+)\}")
_SYNONYMS = [
    (re.compile(r"\\varnothing|\\text\{\s*empty set\s*\}"), r"\\emptyset"),
    (
        re.compile(r"\\mathbb\s*\{?R\}?|(?:\\text\{\s*)?all real numbers\s*\}?"),
        r"(-\\infty, \\infty)",
    ),
]
_WORDS = [
    (re.compile(r"(?<![A-Za-z])pi(?![A-Za-z])"), r"\\pi "),
    (re.compile(r"\b(?:infinity|inf|oo)\b"), r"\\infty "),
]


def _replace_calls(text: str, name: str, render: Callable[[str], str]) -> str:
    """Every `name(...)` in `text` (parentheses matched) replaced by `render(argument)`."""
    guard = "(?<![A-Za-z])" if name.isalpha() else ""
    pattern = re.compile(rf"{guard}{re.escape(name)}\s*\(")
    while (match := pattern.search(text)) is not None:
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if depth:
            return text  # unbalanced: leave it to the parser
        text = text[: match.start()] + render(text[match.end() : end - 1]) + text[end:]
    return text


_ONE_TO_THE = re.compile(r"(?<![\w.}\)\]])1\^\{")  # not the last digit of 21, 0.1, x_1


def _powers_of_one(text: str) -> str:
    """Every `1^{...}` (braces matched) -> `1`, unless its exponent holds `\\infty`."""
    start = 0
    while (match := _ONE_TO_THE.search(text, start)) is not None:
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        if depth:
            return text  # unbalanced: leave it to the parser
        if "\\infty" in text[match.end() : end]:
            start = end
            continue
        text = text[: match.start()] + "1" + text[end:]
        start = match.start() + 1
    return text


def plain_to_latex(text: str) -> str:
    """LaTeX for an answer written as a program would (`pi/2`, `sqrt(17)`, `2**3`)."""
    if "\\" in text or not re.search(r"[a-z*^]", text):
        return text
    text = _SCIENTIFIC.sub(r"\1\\times 10^{\2}", text.replace("**", "^"))
    text = _replace_calls(text, "sqrt", lambda arg: f"\\sqrt{{{arg}}}")
    text = _replace_calls(text, "exp", lambda arg: f"e^{{{arg}}}")
    text = _replace_calls(text, "^", lambda arg: f"^{{{arg}}}")
    for pattern, latex in _WORDS:
        text = pattern.sub(latex, text)
    return text.replace("*", "\\cdot ")


def _vector(body: str) -> str | None:
    """`(a, b)` for a matrix body of one row or one column, else None."""
    rows = [row.strip() for row in re.split(r"\\\\", body) if row.strip()]
    cells = [[cell.strip() for cell in row.split("&")] for row in rows]
    if len(cells) == 1:
        entries = cells[0]
    elif all(len(row) == 1 for row in cells):
        entries = [row[0] for row in cells]
    else:
        return None
    return entries[0] if len(entries) == 1 else f"({', '.join(entries)})"


def matrices(text: str) -> str:
    """One matrix notation (`pmatrix`), and vectors as tuples."""
    text = text.replace("\\langle", "(").replace("\\rangle", ")")
    if "\\begin" not in text:
        return text
    text = _MATRIX_END.sub(r"\\end{pmatrix}", _MATRIX_BEGIN.sub(r"\\begin{pmatrix}", text))
    whole = _ONE_MATRIX.match(text.strip())
    if whole is None or "\\begin" in whole[1]:
        return text
    vector = _vector(whole[1])
    return vector if vector is not None else f"\\begin{{pmatrix}}{whole[1]}\\end{{pmatrix}}"


def relations(text: str) -> str:
    """`\\geq`, `\\leq`, `\\neq` for every spelling of them; a set-builder as its condition."""
    for pattern, latex in _RELATIONS:
        text = pattern.sub(latex, text)
    builder = _SET_BUILDER.match(text.strip())
    return builder[1] if builder else text


def repeating_decimals(text: str) -> str:
    """`0.1\\overline{6}` -> `\\frac{15}{90}`: the exact value of a repeating decimal."""

    def fraction(match: re.Match[str]) -> str:
        whole, fixed, period = match[1] or "0", match[2], match[3]
        numerator = int(whole + fixed + period) - int(whole + fixed)
        denominator = (10 ** len(period) - 1) * 10 ** len(fixed)
        return f"\\frac{{{numerator}}}{{{denominator}}}"

    return _REPEATING.sub(fraction, text) if "overline" in text else text


def rewrite(answer: str) -> str:
    """The answer with every family above brought to its one form."""
    if "\\boxed" in answer or "\\fbox" in answer:
        answer = boxed_list(answer) or answer
    answer = plain_to_latex(answer)
    if "\\sqrt" in answer:  # `4\\sqrt(2)`: the parentheses hold the radicand
        answer = _replace_calls(answer, "\\sqrt", lambda arg: f"\\sqrt{{{arg}}}")
    if "1^{" in answer:
        answer = _powers_of_one(answer)
    answer = _VECTOR_NAME.sub("", _FUNCTION_NAME.sub("", answer))
    for pattern, form in _SYNONYMS:
        answer = pattern.sub(form, answer)
    return relations(matrices(repeating_decimals(answer)))


_PERCENT_SIGN = re.compile(r"\\?%")
_PERCENT_MARK = re.compile(r"%|percent|(?<![A-Za-z])pct(?![A-Za-z])")
_DECIMAL_COMMA = re.compile(r"([+-]?\d+),(\d+)")
_DECIMAL_POINT = re.compile(r"[+-]?\d*\.\d+")


def _decimal_comma(text: str) -> str | None:
    """`1,22` -> `1.22` when the comma cannot group thousands (not three digits after it, or
    nothing but 0 before it: `0,111`); else None."""
    match = _DECIMAL_COMMA.fullmatch(text.strip().strip("$").strip())
    if match is None or (len(match[2]) == 3 and match[1].lstrip("+-") != "0"):
        return None
    return f"{match[1]}.{match[2]}"


def percent_for_integer(pred: str, gold: str) -> bool:
    """A percentage given for a gold that is a plain integer: wrong, whatever its value
    (`25\\%` and `2500\\%` for 25). For a gold of 0.25, `25\\%` is read as 1/4."""
    if "%" not in pred and "p" not in pred:  # the common case, without a regex
        return False
    return (
        _PERCENT_MARK.search(pred) is not None
        and _PERCENT_MARK.search(gold) is None
        and parse_integer(gold) is not None
    )


def other_readings(pred: str, gold: str) -> list[tuple[str, str]]:
    """(pred, gold) pairs to compare besides the pair itself; any equal pair is a right answer.
    - A gold with a percent sign also reads without it when the answer has none: `25` is right
      for `25\\%` (the gold names the unit), while `25\\%` for a gold of 25 is 1/4, wrong.
    - A decimal comma (`1,22`, `0,111`) reads as a point when the other side is a decimal
      (`1.22`); a comma before three digits is a thousands separator (`1,220` is 1220).
    """
    pairs = []
    if "%" in gold and _PERCENT_MARK.search(pred) is None:
        pairs.append((pred, _PERCENT_SIGN.sub("", gold)))
    for comma, point, swapped in ((pred, gold, False), (gold, pred, True)):
        if "," in comma and "." in point and _DECIMAL_POINT.fullmatch(point.strip("$ ")):
            read = _decimal_comma(comma)
            if read is not None:
                pairs.append((point, read) if swapped else (read, point))
    return pairs
