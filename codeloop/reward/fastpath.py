"""The cheap decisions, taken in the caller without sympy; anything else goes to the workers.

`fast_check(pred, gold)` returns True or False only when the rules below decide it, and None
otherwise (the symbolic path then decides, with the same semantics):
1. Both are plain numbers or ratios of two (`integer.parse_simple`): exact comparison, except
   that a decimal of 12 significant digits or more is a printed float: it equals a value with
   no finite decimal expansion that it rounds or truncates (`0.0833333333333333` is 1/12).
2. The normalised forms (`symbolic.normalise`) are equal.
3. A one-letter assignment (`x = 5`) is read as its value, as the symbolic path does; two
   different letters (`x = 5`, `y = 5`) are left to it.
4. Both are the same shape built from such numbers: a set `\\{a, b\\}` or a bare list `a, b`
   (unordered), a tuple or an interval with the same brackets `(a, b)`, `[a, b)` (ordered);
   `\\infty` may be an end.
"""

from __future__ import annotations

import re
from fractions import Fraction

from codeloop.reward.forms import other_readings, percent_for_integer
from codeloop.reward.integer import parse_simple, same_number
from codeloop.reward.symbolic import normalise

_ASSIGNMENT = re.compile(r"^([A-Za-z])=(?!=)")
_BRACKETS = re.compile(r"^(\\\{|[(\[])(.*)(\\\}|[)\]])$")
_INFINITY = {"\\infty": "+inf", "+\\infty": "+inf", "-\\infty": "-inf"}

Value = Fraction | str  # a number, or "+inf" / "-inf"


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "{([":
            depth += 1
        elif char in "})]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _values(parts: list[str]) -> list[Value] | None:
    values: list[Value] = []
    for part in parts:
        value = _INFINITY.get(part) or parse_simple(part)
        if value is None:
            return None
        values.append(value)
    return values


def _shape(form: str) -> tuple[str, list[Value]] | None:
    """(kind, values) of a normalised answer made of simple numbers, or None."""
    match = _BRACKETS.match(form)
    if match and match[1] == "\\{" and match[3] == "\\}":
        values = _values(_split_top_level(match[2]))
        return ("set", sorted(values, key=str)) if values else None
    if match and match[1] in "([" and match[3] in ")]":
        values = _values(_split_top_level(match[2]))
        return (match[1] + match[3], values) if values and len(values) >= 2 else None
    parts = _split_top_level(form)
    values = _values(parts) if len(parts) >= 2 else None
    return ("set", sorted(values, key=str)) if values else None


def _unassigned(pred: str, gold: str) -> tuple[str, str] | None:
    pred_var, gold_var = _ASSIGNMENT.match(pred), _ASSIGNMENT.match(gold)
    if pred_var and gold_var and pred_var[1] != gold_var[1]:
        return None
    return _ASSIGNMENT.sub("", pred), _ASSIGNMENT.sub("", gold)


def fast_check(pred: str, gold: str) -> bool | None:
    """The verdict when the cheap rules decide it; None sends the pair to the workers.
    Right when any reading of the pair (`forms.other_readings`: percent, decimal comma) is."""
    if percent_for_integer(pred, gold):
        return False
    verdict = _decide(pred, gold)
    if verdict is True:
        return True
    for other_pred, other_gold in other_readings(pred, gold):
        other = _decide(other_pred, other_gold)
        if other is True:
            return True
        if other is None:
            verdict = None
    return verdict


def _decide(pred: str, gold: str) -> bool | None:
    gold_value = parse_simple(gold)
    if gold_value is not None:
        pred_value = parse_simple(pred)
        if pred_value is not None:
            return same_number(pred, pred_value, gold, gold_value)
    pred_form, gold_form = normalise(pred), normalise(gold)
    if pred_form == gold_form:
        return bool(pred_form)
    unassigned = _unassigned(pred_form, gold_form)
    if unassigned is None:
        return None
    pred_form, gold_form = unassigned
    pred_value, gold_value = parse_simple(pred_form), parse_simple(gold_form)
    if pred_value is not None and gold_value is not None:
        return same_number(pred_form, pred_value, gold_form, gold_value)
    pred_shape, gold_shape = _shape(pred_form), _shape(gold_form)
    if pred_shape is None or gold_shape is None or pred_shape[0] != gold_shape[0]:
        return None
    return pred_shape[1] == gold_shape[1]
