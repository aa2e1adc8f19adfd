"""Forms math-verify's suite holds, and exactness where numeric closeness would mislead."""

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codeloop.config import RewardConfig
from codeloop.reward.integer import printed_float, rounds_to
from codeloop.reward.verifier import Verifier


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    with Verifier(RewardConfig(workers=1, deadline_s=60.0)) as v:
        yield v


def _right(verifier: Verifier, answer: str, gold: str) -> bool:
    return verifier.score(f"<answer>\\boxed{{{answer}}}</answer>", gold).reward == 1.0


@pytest.mark.parametrize(
    ("answer", "gold", "right"),
    [
        # numbers with separators, decimal commas, currency and units
        ("2,74 $", "2.74", True),
        ("1,000.99€", "1000.99", True),
        ("1,000.99m²", "1000.99", True),
        ("\\$1,000.99", "1000.99", True),
        ("11,\\! 111,\\! 111,\\! 100", "11111111100", True),  # `,\!` glues the groups
        ("32,\\! 349", "32349", True),
        ("32, 349", "32349", False),  # a comma and a space: a list of two numbers
        # relations in every spelling
        ("x \\lt 3", "x < 3", True),
        ("x \\gt 5", "x > 5", True),
        ("x != 5", "x \\neq 5", True),
        ("x \\geq 5", "x >= 5", True),
        ("x \\geq 5", "x > 5", False),
        # matrices
        (
            "\\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right]",
            "\\begin{pmatrix}1 & 2 \\\\3 & 4\\end{pmatrix}",
            True,
        ),  # noqa: E501
        (
            "\\begin{pmatrix}0 & 0 \\\\0 & 0\\end{pmatrix}",
            "\\begin{bmatrix}0 & 0 \\\\0 & 0\\end{bmatrix}",
            True,
        ),  # noqa: E501
        # a printed float stands for the value it rounds; a rounded decimal does not
        ("0.0833333333333333", "\\frac{1}{12}", True),
        ("4.123105625617661", "\\sqrt{17}", True),
        ("\\sqrt{17}", "4.123105625617661", True),
        ("0.333333333333", "\\frac13", True),  # 12 significant digits
        ("0.33333333333", "\\frac13", False),  # 11
        ("0.333333333334", "\\frac13", True),  # rounded up in the last digit
        ("0.333333333335", "\\frac13", False),  # more than one unit of the last digit away
        ("4.99999999999999", "5", False),  # an integer is written exactly
        ("0.1250000000001", "\\frac18", False),  # so is a value a decimal writes exactly
        # numbers equal only when they are: not when their difference is merely tiny
        ("\\frac{1}{2006!}", "\\frac{1}{2004!}", False),
        ("\\frac{1}{2^{98}}", "\\frac{1}{2^{99}}", False),
        ("(0, \\frac{1}{2^{98}})", "(0, \\frac{1}{2^{99}})", False),
        ("\\frac{1}{3}+10^{-40}", "\\frac13", False),
        ("10^{-50}", "0", False),
        ("\\frac{1}{2^{99}}", "2^{-99}", True),
        ("\\sqrt{8}", "2\\sqrt{2}", True),
        ("\\frac{\\sqrt{6}}{2}", "\\sqrt{\\frac32}", True),
        # an answer with extra terms is not its leading number
        ("4\\sqrt(2)", "4", False),
        ("4\\sqrt(2)", "4\\sqrt{2}", True),
        ("4\\sqrt{2}", "4", False),
        # a power of 1 is 1 without evaluating its exponent; other powers are left alone
        ("1^{(2^{235423523})}", "1", True),
        ("1^{2}+1^{3}", "2", True),
        ("\\frac{1^{5}}{3}", "\\frac13", True),
        ("21^{2}", "441", True),
        ("0.1^{2}", "0.01", True),
        ("x_1^{2}", "1", False),
        # misreadings that would accept a wrong answer on an integer gold
        ("-[0,1)", "1", False),
        ("Answer $ \n 9 \n $", "9", False),  # inline math ends at the line
        ("Answer \\( \n 9 \n \\)", "9", False),
        ("Answer $ 9 $", "9", True),
        ("Answer $$ \n 9 \n $$", "9", True),  # display math may span lines
        # percentages: the gold's percent sign names the unit; an integer gold has none
        ("100", "100\\%", True),
        ("100\\%", "100", False),
    ],
)
def test_forms_and_exactness(verifier: Verifier, answer: str, gold: str, right: bool) -> None:
    assert _right(verifier, answer, gold) == right


def test_printed_floats_need_twelve_digits_and_a_value_without_an_end() -> None:
    assert printed_float("0.0833333333333333") == (
        Fraction(833333333333333, 10**16),
        Fraction(1, 10**16),
    )
    assert printed_float("0.08333333333") is None  # 10 significant digits
    assert printed_float("123456789012") is None  # no decimal point: an integer
    assert rounds_to(Fraction(2, 3), "0.666666666667")
    assert rounds_to(Fraction(2, 3), "0.666666666666")  # truncated
    assert not rounds_to(Fraction(2, 3), "0.666666666665")
    assert not rounds_to(Fraction(3, 4), "0.750000000000")  # 3/4 is written 0.75


# --- a number never equals a different number, whatever its spelling ------------------------

VALUES = st.builds(
    Fraction,
    st.integers(-99_999, 99_999),
    st.sampled_from([1, 1, 2, 4, 5, 8, 10, 100, 3, 7, 12]),
)


def _spellings(value: Fraction) -> list[str]:
    """Ways a model writes `value` exactly."""
    p, q = value.numerator, value.denominator
    sign = "-" if value < 0 else ""
    forms = [f"\\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"{sign}\\dfrac{{{abs(p) * 3}}}{{{q * 3}}}"]
    if q == 1:
        forms += [
            str(p),
            f"{p:,}",
            f"{p:,}".replace(",", "{,}"),
            f"{p}.0",
            f"\\text{{{p}}}",
            f"{p} \\text{{ cm}}",
            f"{sign}\\${abs(p)}",
            f"{p:,}".replace(",", ",\\!"),
        ]
    elif 10**6 % q == 0:  # a terminating decimal, written exactly
        forms.append(f"{float(value):.6f}".rstrip("0"))  # a decimal comma is a list here
    return forms


@settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(VALUES, st.one_of(st.none(), VALUES), st.randoms(use_true_random=False))
def test_a_number_matches_exactly_the_numbers_equal_to_it(
    verifier: Verifier, a: Fraction, other: Fraction | None, rng: object
) -> None:
    b = a if other is None else other  # the same value, spelt another way, half of the time
    answer = rng.choice(_spellings(a))  # type: ignore[attr-defined]
    gold = rng.choice(_spellings(b))  # type: ignore[attr-defined]
    assert _right(verifier, answer, gold) == (a == b), (answer, gold)
