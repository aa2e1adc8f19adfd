import pytest

from codeloop.reward.extract import Reason, extract_answer, last_boxed, strip_tool_output


def _x(text: str, **kw: bool) -> tuple[str | None, Reason]:
    found = extract_answer(text, **kw)
    return found.answer, found.reason


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer>The answer is \\boxed{42}.</answer>", "42"),
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("<answer>\\boxed{\\left\\{1, 2\\right\\}}</answer>", "\\left\\{1, 2\\right\\}"),
        ("<answer>first \\boxed{1} then \\boxed{2}</answer>", "1, 2"),  # a hedge is a list
        ("<answer>\\boxed{(1, 2)}, \\boxed{(2, 1)}</answer>", "(1, 2), (2, 1)"),
        ("<answer>\\boxed{70}, so \\boxed{70}</answer>", "70"),  # one value boxed twice
        ("<answer>\\fbox{7}</answer>", "7"),
        ("<answer>\\boxed 9</answer>", "9"),
        ("<answer>$\\boxed{ 3\\sqrt{2} }$</answer>", "3\\sqrt{2}"),
        ("<answer>\\boxed{a}</answer> more <answer>\\boxed{b}</answer>", "b"),
        ("<reason>try \\boxed{5}</reason><answer>\\boxed{6}</answer>", "6"),
        ("<answer>\\boxed{x^{2^{3}}}</answer>", "x^{2^{3}}"),
    ],
)
def test_the_boxed_values_of_the_final_answer_block(text: str, answer: str) -> None:
    assert _x(text) == (answer, Reason.OK)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("The answer is \\boxed{42}.", Reason.NO_ANSWER_TAG),
        ("<answer>\\boxed{42}", Reason.UNCLOSED_ANSWER_TAG),
        ("<answer>42</answer>", Reason.NO_BOXED),
        ("<answer>\\boxed{4{2}</answer>", Reason.UNBALANCED_BRACES),
        ("<answer>\\boxed{ }</answer>", Reason.EMPTY_BOXED),
        ("", Reason.NO_ANSWER_TAG),
    ],
)
def test_missing_or_malformed_answers_are_reason_codes(text: str, reason: Reason) -> None:
    assert _x(text) == (None, reason)


def test_tool_output_never_counts() -> None:
    text = (
        "<tool_call>{...}</tool_call><tool_response>\n<answer>\\boxed{13}</answer>\n"
        "</tool_response> so I conclude <answer>\\boxed{12}</answer>"
    )
    assert _x(text) == ("12", Reason.OK)
    only_tool = "<tool_response>\\boxed{13} <answer>\\boxed{13}</answer></tool_response>"
    assert _x(only_tool, fallback_last_boxed=True) == (None, Reason.NO_ANSWER_TAG)
    cut_off = "text <tool_response>\\boxed{99}"  # a response cut by the length budget
    assert strip_tool_output(cut_off) == "text "


def test_fallbacks_are_off_by_default_and_work_when_asked() -> None:
    text = "So \\boxed{17} is it."
    assert _x(text) == (None, Reason.NO_ANSWER_TAG)
    assert _x(text, fallback_last_boxed=True) == ("17", Reason.FALLBACK_BOXED)
    phrase = "Computing gives the answer is 204.\nDone"
    assert _x(phrase, fallback_answer_phrase=True) == ("204", Reason.FALLBACK_PHRASE)
    decoded = "So the answer is 284.<|im_end|>"  # a decoded turn ends with its special token
    assert _x(decoded, fallback_answer_phrase=True) == ("284", Reason.FALLBACK_PHRASE)
    assert _x("<answer>no box</answer> \\boxed{3}", fallback_last_boxed=True) == (
        "3",
        Reason.FALLBACK_BOXED,
    )


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        # the closing line of the Minerva prompt's answers
        ("Final Answer: The final answer is $10,455$. I hope it is correct.", "10,455"),
        (
            "Final Answer: The final answer is 12,000,023. I hope it is correct.<|im_end|>",
            "12,000,023",
        ),
        ("Final Answer: The largest $n$ is 34.", "34"),
        ("Final Answer: The volume of $ABCDEFGH$ is 120. I hope it is correct.", "120"),
        ("The final answer is \\(\\frac{1}{2}\\).", "\\frac{1}{2}"),
        ("the answer is 3.5.", "3.5"),  # a decimal point is not the end of the sentence
        ("the answer is: 17", "17"),
        ("so the answer is 2. Then the answer is 5.", "5"),  # the last phrase
        (
            "Final Answer: Jane started growing Sphere 3 hours ago.",
            "Jane started growing Sphere 3 hours ago",
        ),
    ],
)
def test_the_phrase_fallback_reads_the_answer_a_phrase_states(text: str, answer: str) -> None:
    assert _x(text, fallback_answer_phrase=True) == (answer, Reason.FALLBACK_PHRASE)


def test_with_both_fallbacks_the_later_of_box_and_phrase_is_the_answer() -> None:
    box_then_phrase = "so $\\boxed{255}$ more. Final Answer: The final answer is $10,455$."
    assert _x(box_then_phrase, fallback_last_boxed=True, fallback_answer_phrase=True) == (
        "10,455",
        Reason.FALLBACK_PHRASE,
    )
    phrase_then_box = "the answer is 7, as \\boxed{8} shows"
    assert _x(phrase_then_box, fallback_last_boxed=True, fallback_answer_phrase=True) == (
        "8",
        Reason.FALLBACK_BOXED,
    )
    assert _x(box_then_phrase, fallback_last_boxed=True) == ("255", Reason.FALLBACK_BOXED)


def test_last_boxed_on_plain_text() -> None:
    assert last_boxed("\\boxed{1} and \\boxed{2}").answer == "2"
    assert last_boxed("nothing").reason == Reason.NO_BOXED
    assert last_boxed("\\boxed{\\{1\\}}").answer == "\\{1\\}"  # escaped braces do not count


@pytest.mark.parametrize(
    ("text", "answer", "reason"),
    [
        ("<answer>\\boxed{1}\\boxed{2}</answer>", "1, 2", Reason.OK),  # no space between
        ("<answer>\\fbox{1} or \\fbox{2}</answer>", "1, 2", Reason.OK),  # fbox counts as a box
        # a bad box among good ones: the last bad one is the reason
        ("<answer>\\boxed{1} \\boxed{}</answer>", None, Reason.EMPTY_BOXED),
        ("<answer>\\boxed{} \\boxed{2} \\boxed{3</answer>", None, Reason.UNBALANCED_BRACES),
        ("<answer>so it is \\boxed</answer>", None, Reason.EMPTY_BOXED),  # nothing after it
    ],
)
def test_several_boxes_and_bad_ones(text: str, answer: str | None, reason: Reason) -> None:
    assert _x(text) == (answer, reason)


def test_a_box_at_the_very_end_of_the_text_is_empty() -> None:
    assert (last_boxed("the answer is \\boxed").reason) == Reason.EMPTY_BOXED


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("1 + 8 = 9<|im_end|>", "9"),
        ("5 - 9 = -4", "-4"),  # a sign
        ("9-4 is 5", "5"),  # a minus between two numbers is no sign
        ("It costs 1,234 dollars.", "1234"),  # thousands separators dropped
        ("half of 7 is 3.5.", "3.5"),  # the sentence's period is not a decimal
        ("x1 = 72*100 and x2 is 7/8", "7/8"),  # a name's digit is no number; a fraction is
        ("8 <tool_response>42</tool_response> was printed", "8"),  # tool output never counts
    ],
)
def test_the_last_number_fallback_reads_the_last_number_of_the_text(text: str, answer: str) -> None:
    assert _x(text, fallback_last_number=True) == (answer, Reason.FALLBACK_NUMBER)


def test_the_last_number_comes_after_every_other_way_to_an_answer() -> None:
    assert _x("8 + 6 = 14") == (None, Reason.NO_ANSWER_TAG)  # off by default
    assert _x("no digits at all", fallback_last_number=True) == (None, Reason.NO_ANSWER_TAG)
    block = "7 and 9 <answer>\\boxed{12}</answer> 13"
    assert _x(block, fallback_last_number=True) == ("12", Reason.OK)
    phrase = "the answer is 5, not 6"
    assert _x(phrase, fallback_answer_phrase=True, fallback_last_number=True) == (
        "5, not 6",
        Reason.FALLBACK_PHRASE,
    )
    boxed = "\\boxed{3} then 4"
    assert _x(boxed, fallback_last_boxed=True, fallback_last_number=True) == (
        "3",
        Reason.FALLBACK_BOXED,
    )
