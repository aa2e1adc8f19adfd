"""Final-answer extraction from the assistant's own text. Pure functions, no I/O.

The answer is the `\\boxed{...}` (or `\\fbox{...}`) inside the final `<answer>...</answer>`
block, with brace matching; several distinct boxed values there are one list `a, b`. Tool
output never counts: `<tool_response>` blocks are removed before anything is searched, so a
boxed value printed by code cannot become the answer.
Optional fallbacks (off by default, as in the report): the last boxed value anywhere in the
assistant's text, and "the answer is ..." / "Final Answer: ... is X." phrases; with both on,
whichever comes later in the text is the answer; and, when nothing else gave one, the last number
of the assistant's text (the lenient extraction of GSM8K-style scorers, e.g. `8 + 6 = 14`). A
missing or malformed answer is a reason code, never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from codeloop.types import StrEnum


class Reason(StrEnum):
    """Why extraction produced what it did."""

    OK = "ok"  # boxed value inside the final <answer>
    FALLBACK_BOXED = "fallback_boxed"  # no usable <answer>; last boxed value of the text
    FALLBACK_PHRASE = "fallback_phrase"  # "the answer is ..."
    FALLBACK_NUMBER = "fallback_number"  # nothing else; the last number of the text
    NO_ANSWER_TAG = "no_answer_tag"
    UNCLOSED_ANSWER_TAG = "unclosed_answer_tag"  # e.g. cut off by the length budget
    NO_BOXED = "no_boxed"  # an <answer> block without \boxed{}
    UNBALANCED_BRACES = "unbalanced_braces"
    EMPTY_BOXED = "empty_boxed"


@dataclass(frozen=True, slots=True)
class Extraction:
    answer: str | None
    reason: Reason


# <|im_end|>, <|eot_id|>, Gemma's <end_of_turn>: markup, not text
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>|<(?:start|end)_of_turn>")
_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(</tool_response>|\Z)", re.DOTALL)
_BOX = re.compile(r"\\(?:boxed|fbox)\b\s*")
# "the answer is X", "Final Answer: The final answer is $X$. I hope it is correct." (the
# Minerva prompt's closing line), "Final Answer: The largest $n$ is 34.": the answer is inline
# math or runs to the end of its sentence (a period before a space or the end of the line).
_PHRASE = re.compile(
    r"(?:answer is|final answer:(?:[^\n.]*?\bis\b)?)[:\s]*"
    r"(?:\$([^$\n]+)\$|\\\((.+?)\\\)|(.+?))\s*(?:\.(?=\s|$)|$)",
    re.IGNORECASE | re.MULTILINE,
)
# a number as text writes it: a sign, thousands separated by commas, decimals, a fraction a/b
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?(?![\w/])")


def strip_tool_output(text: str) -> str:
    """The text with every tool response (closed, or cut off at the end) and every special
    token (`<|im_end|>`, `<end_of_turn>`: a decoded trajectory holds one at the end of each
    turn) removed."""
    if "<|" in text or "_of_turn>" in text:
        text = _SPECIAL_TOKEN.sub("\n", text)
    return _TOOL_RESPONSE.sub("", text) if "<tool_response>" in text else text


def _braced(text: str, start: int) -> tuple[str | None, int]:
    """Content of the brace group opening at `start`, and the index after it (None: unbalanced)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{" and text[i - 1 : i] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1 : i] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None, len(text)


def _box_at(text: str, end: int) -> tuple[Extraction, int]:
    """The boxed value whose `\\boxed` ends at `end`, and the index after it."""
    if end < len(text) and text[end] == "{":
        content, after = _braced(text, end)
        if content is None:
            return Extraction(None, Reason.UNBALANCED_BRACES), after
    else:  # `\boxed 42`: the next token
        token = re.match(r"[^\s$<]+", text[end:])
        content, after = (token.group(0) if token else ""), end
    content = content.strip()
    found = Extraction(content, Reason.OK) if content else Extraction(None, Reason.EMPTY_BOXED)
    return found, after


def _boxes(text: str) -> list[Extraction]:
    """Every top-level `\\boxed{...}` / `\\fbox{...}` of `text` in order (`\\boxed 7` too)."""
    found, position = [], 0
    while (match := _BOX.search(text, position)) is not None:
        box, position = _box_at(text, match.end())
        found.append(box)
        if box.reason == Reason.UNBALANCED_BRACES:
            break
    return found


def joined_boxes(boxes: list[Extraction]) -> str:
    """Distinct boxed values in order, as one list `a, b` (one value boxed twice is one)."""
    return ", ".join(dict.fromkeys(box.answer for box in boxes if box.answer is not None))


def boxed_list(text: str) -> str:
    """The top-level boxed values of `text` as one list `a, b`; "" when there are none."""
    return joined_boxes(_boxes(text))


def last_boxed(text: str) -> Extraction:
    """The last `\\boxed{...}` / `\\fbox{...}` of `text`."""
    last = None
    for last in _BOX.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    return _box_at(text, last.end())[0] if last else Extraction(None, Reason.NO_BOXED)


def all_boxed(text: str) -> Extraction:
    """The boxed answer of an answer block: several distinct boxed values are one list `a, b`
    (a hedge is then a list, which never equals a single-valued gold)."""
    if text.count("\\boxed") + text.count("\\fbox") <= 1:  # the common case
        return last_boxed(text)
    boxes = _boxes(text)
    bad = [box for box in boxes if box.answer is None]
    return bad[-1] if bad else Extraction(joined_boxes(boxes), Reason.OK)


def _final_answer_block(text: str) -> tuple[str | None, Reason]:
    start = text.rfind("<answer>")
    if start < 0:
        return None, Reason.NO_ANSWER_TAG
    end = text.find("</answer>", start)
    if end < 0:
        return None, Reason.UNCLOSED_ANSWER_TAG
    return text[start + len("<answer>") : end], Reason.OK


def extract_answer(
    assistant_text: str,
    *,
    fallback_last_boxed: bool = False,
    fallback_answer_phrase: bool = False,
    fallback_last_number: bool = False,
) -> Extraction:
    """The final answer of a response (see the module docstring for the rules)."""
    text = strip_tool_output(assistant_text)
    block, reason = _final_answer_block(text)
    if block is not None:
        found = all_boxed(block)
        if found.answer is not None or found.reason != Reason.NO_BOXED:
            return found
        reason = Reason.NO_BOXED
    phrase = _last_phrase(text) if fallback_answer_phrase else None
    if fallback_last_boxed:  # the later of the last box and the last phrase is the answer
        box = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
        found = last_boxed(text)
        if found.answer is not None and (phrase is None or box > phrase[1]):
            return Extraction(found.answer, Reason.FALLBACK_BOXED)
    if phrase is not None:
        return Extraction(phrase[0], Reason.FALLBACK_PHRASE)
    if fallback_last_number and (number := _last_number(text)) is not None:
        return Extraction(number, Reason.FALLBACK_NUMBER)
    return Extraction(None, reason)


def _last_number(text: str) -> str | None:
    """The last number of `text`, its thousands separators dropped (`1,234` -> `1234`)."""
    found = None
    for found in _NUMBER.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    return found.group().replace(",", "") if found else None


def _last_phrase(text: str) -> tuple[str, int] | None:
    """The answer the last "answer is ..." / "Final Answer: ..." phrase states, and where."""
    found = None
    for match in _PHRASE.finditer(text):
        answer = next(group for group in match.groups() if group is not None).strip()
        if answer:
            found = (answer, match.start())
    return found
