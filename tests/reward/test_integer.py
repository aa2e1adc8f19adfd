from fractions import Fraction

import pytest

from codeloop.reward.integer import parse_integer

ACCEPTED = [
    ("1000", 1000),
    ("1,000", 1000),
    ("1{,}000", 1000),
    ("1\\,000", 1000),
    ("1\\!000", 1000),
    ("1 000", 1000),
    ("1\u2009000", 1000),
    ("1000.0", 1000),
    ("1000.000", 1000),
    ("+1000", 1000),
    ("01000", 1000),
    ("007", 7),
    ("$1000$", 1000),
    ("\\text{1000}", 1000),
    ("\\textbf{\\text{1000}}", 1000),
    ("\\mathrm{1000}", 1000),
    ("1000^\\circ", 1000),
    ("1000^{\\circ}", 1000),
    ("1000°", 1000),
    ("100000\\%", 1000),
    ("100000%", 1000),
    ("\\$1000", 1000),
    ("1000\\$", 1000),
    ("$1000\\$$", 1000),
    ("1000 \\text{ cm}", 1000),
    ("1000 dollars", 1000),
    ("1000 square units", 1000),
    ("  42  ", 42),
    ("-7", -7),
    ("- 7", -7),
    ("-0", 0),
    ("1,000,000", 1_000_000),
    ("1e3", 1000),
    ("1.5E3", 1500),
    ("USD 1000", 1000),
    ("1000 \\text{ m}^2", 1000),
    ("1000 km/h", 1000),
    ("1000 \\text{m}", 1000),
    ("3\\,375", 3375),
    ("12345678901234567890", 12345678901234567890),
    ("25€", 25),
    ("25 £", 25),
]

REJECTED = [
    "0.25",
    "25.1",
    "103.99",
    "1000.5",
    "1,00",
    "1000,000",
    "12x",
    "5/2",
    "1e-3",
    "25\\%",
    "32, 349",
    "1e100000",
    "12 x",
    "5 m^4",
    "\\frac{1}{2}",
    "\\frac{4}{2}",
    "2\\sqrt{3}",
    "\\sqrt{4}",
    "",
    "   ",
    "abc",
    "x = 5",
    "5, 6",
    "(1, 2)",
    "\\infty",
    "1.2.3",
    "12 x",
    "2^{10}",
    "10!",
]


@pytest.mark.parametrize(("text", "value"), ACCEPTED)
def test_accepted_spellings(text: str, value: int) -> None:
    assert parse_integer(text) == value


@pytest.mark.parametrize("text", REJECTED)
def test_not_plain_integers_are_left_to_the_symbolic_path(text: str) -> None:
    assert parse_integer(text) is None


def test_no_tolerance_and_no_percentage_rule() -> None:
    # The released rStar2-Agent grader accepts these for golds 25 and 104; we do not.
    assert parse_integer("2500") != 25
    assert parse_integer("0.25") is None
    assert parse_integer("103.99") is None


def test_an_exponent_up_to_400_is_a_number_and_beyond_it_is_not() -> None:
    from codeloop.reward.integer import parse_number

    assert parse_number("1e400") == 10**400 and parse_number("1e-400") == Fraction(1, 10**400)
    assert parse_number("1e401") is None and parse_number("1e-401") is None


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (" 3 / 4 ", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\frac{1}{2}", Fraction(-1, 2)),
        ("\\dfrac34", Fraction(3, 4)),
        ("\\tfrac{10}{4}", Fraction(5, 2)),
        ("$\\frac{3}{4}$", Fraction(3, 4)),
        ("5", Fraction(5)),
        ("1,000/4", Fraction(250)),
        ("3/0", None),
        ("x/4", None),
        ("3/y", None),
        ("3/4/5", None),
        ("\\frac{a}{b}", None),
        ("\\frac{3}{0}", None),
        ("", None),
    ],
)
def test_parse_simple_reads_a_number_or_a_ratio_of_two(answer: str, value: Fraction | None) -> None:
    from codeloop.reward.integer import parse_simple

    assert parse_simple(answer) == value
