"""The answer families of `reward/forms.py`, each rewrite checked by hand, and the policies of
docs/reward.md's table through the whole verifier."""

import logging

import pytest

from codeloop.reward import forms
from codeloop.reward.fastpath import fast_check
from codeloop.reward.symbolic import equivalent

logging.getLogger("math_verify").setLevel(logging.ERROR)


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("pi/2", "\\pi /2"),
        ("-2*pi", "-2\\cdot \\pi "),
        ("exp(16)", "e^{16}"),
        ("sqrt(17)", "\\sqrt{17}"),
        ("(1+sqrt(5))/2", "(1+\\sqrt{5})/2"),
        ("x**2", "x^2"),
        ("2^(1/3)", "2^{1/3}"),
        ("sqrt(sqrt(2))", "\\sqrt{\\sqrt{2}}"),
        ("inf", "\\infty "),
        ("1.5e3", "1.5\\times 10^{3}"),
        ("Monday", "Monday"),
        ("spin", "spin"),
        ("\\sqrt{2}*3", "\\sqrt{2}*3"),  # LaTeX already: left alone
        ("sqrt(2", "sqrt(2"),  # unbalanced: left to the parser
    ],
)
def test_plain_text_math_becomes_latex(text: str, form: str) -> None:
    assert forms.plain_to_latex(text) == form


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)"),
        ("\\begin{bmatrix} 1 & 2 \\end{bmatrix}", "(1, 2)"),
        ("(\\begin{array}{c} 3 \\\\ 4 \\\\ 5 \\end{array})", "(3, 4, 5)"),
        ("\\langle 1, 2 \\rangle", "( 1, 2 )"),
        (
            "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}",
            "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}",
        ),
        (
            "\\begin{vmatrix} 1 & 2 \\\\ 3 & 4 \\end{vmatrix}",
            "\\begin{vmatrix} 1 & 2 \\\\ 3 & 4 \\end{vmatrix}",
        ),  # a determinant: left alone
    ],
)
def test_matrices_and_vectors(text: str, form: str) -> None:
    assert forms.matrices(text) == form


def test_relations_and_set_builder() -> None:
    assert forms.relations("x >= 3") == "x \\geq  3"
    assert forms.relations("x ≠ 3") == "x \\neq  3"
    assert forms.relations("x \\ge 3, y \\le 2") == "x \\geq  3, y \\leq  2"
    assert forms.relations("\\{x \\mid 1 \\le x < 3\\}") == "1 \\leq  x < 3"
    assert forms.relations("\\{x : x > 0\\}") == "x > 0"
    assert forms.relations("\\{1, 2\\}") == "\\{1, 2\\}"  # a set, not a builder


def test_repeating_decimals_are_exact_fractions() -> None:
    assert forms.repeating_decimals("0.\\overline{3}") == "\\frac{3}{9}"
    assert forms.repeating_decimals("0.1\\overline{6}") == "\\frac{15}{90}"  # 1/6
    assert forms.repeating_decimals("2.\\overline{45}") == "\\frac{243}{99}"  # 27/11


def test_rewrite_reads_names_and_several_boxes() -> None:
    assert forms.rewrite("f(x) = x + 1") == "x + 1"
    assert forms.rewrite("\\mathbf{v} = (1, 2)") == "(1, 2)"
    assert forms.rewrite("\\boxed{(1, 2)}, \\boxed{(2, 1)}") == "(1, 2), (2, 1)"
    assert forms.rewrite("\\boxed{5} so \\boxed{5}") == "5"
    assert forms.rewrite("x = 5") == "x = 5"  # a variable's name is kept (x = 5 is not y = 5)


def test_other_readings() -> None:
    assert forms.other_readings("25", "25\\%") == [("25", "25")]
    assert forms.other_readings("25\\%", "25\\%") == []
    assert forms.other_readings("1,22", "1.22") == [("1.22", "1.22")]
    assert forms.other_readings("1,220", "1.22") == []  # three digits: thousands
    assert forms.other_readings("1,22", "122") == []  # the gold is not a decimal
    assert forms.percent_for_integer("25\\%", "25")
    assert not forms.percent_for_integer("25\\%", "0.25")


POLICIES = [
    # percent: a unit of 1/100; the gold's own percent sign accepts the bare number
    ("25\\%", "25", False),
    ("2500\\%", "25", False),
    ("25", "25\\%", True),
    ("0.25", "25\\%", True),
    ("25\\%", "0.25", True),
    ("26", "25\\%", False),
    # a comma and a space separate; a comma before three digits groups thousands
    ("32, 349", "32349", False),
    ("32,349", "32349", True),
    ("1,22", "1.22", True),
    ("1,220", "1.22", False),
    # several boxed answers are a list
    ("\\boxed{70}, \\boxed{80}", "70", False),
    ("\\boxed{(1, 2)}, \\boxed{(2, 1)}", "(1, 2), (2, 1)", True),
    # no unit conversion, no rounding
    ("90^\\circ", "\\frac{\\pi}{2}", False),
    ("0.33", "\\frac13", False),
    ("1800 cents", "18", False),
    # families
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)", True),
    ("pi/2", "\\frac{\\pi}{2}", True),
    ("exp(16)", "e^{16}", True),
    ("-2*pi", "-2\\pi", True),
    ("[1, 3]", "\\{x \\mid 1 \\le x \\le 3\\}", True),
    ("x >= 3", "x \\geq 3", True),
    ("x != 3", "x \\neq 3", True),
    ("g(x) = x + 1", "f(x) = x + 1", True),
    ("f(x) = x + 2", "x + 1", False),
    ("60 \\text{ km/h}", "60", True),
    ("\\$1,250", "1250", True),
    ("USD 18", "18", True),
    ("12 x", "12", False),
    ("0.\\overline{3}", "\\frac13", True),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), POLICIES)
def test_policies_on_both_paths(pred: str, gold: str, expected: bool) -> None:
    fast = fast_check(pred, gold)
    assert (fast if fast is not None else equivalent(pred, gold)) is expected
    assert equivalent(pred, gold) is expected  # the workers' path decides the same alone


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("\\begin{pmatrix}5\\end{pmatrix}", "5"),  # one entry: the entry
        ("\\begin{bmatrix}1 \\\\ 2\\end{bmatrix}", "(1, 2)"),  # a column: a tuple
        ("\\begin{pmatrix}1 & 2\\end{pmatrix}", "(1, 2)"),  # a row: a tuple
        # rows of unequal length: neither a row nor a column, kept as a matrix
        (
            "\\begin{pmatrix}1 & 2 \\\\ 3\\end{pmatrix}",
            "\\begin{pmatrix}1 & 2 \\\\ 3\\end{pmatrix}",
        ),
    ],
)
def test_matrices_of_one_row_or_column_are_tuples(text: str, form: str) -> None:
    assert forms.matrices(text) == form


def test_rewrite_takes_the_answer_out_of_its_box() -> None:
    assert forms.rewrite("\\boxed{5}") == "5"
    assert forms.rewrite("\\fbox{7}") == "7"


@pytest.mark.parametrize(
    ("pred", "gold", "wrong"),
    [
        ("25\\%", "25", True),
        ("25%", "25", True),
        ("25 percent", "25", True),
        ("25 pct", "25", True),
        ("25", "25", False),
        ("25\\%", "0.25", False),
        ("25\\%", "25\\%", False),
        ("2 apples", "2", False),
    ],
)
def test_a_percentage_for_an_integer_gold(pred: str, gold: str, wrong: bool) -> None:
    assert forms.percent_for_integer(pred, gold) is wrong


def test_other_readings_keep_the_answer_on_its_side() -> None:
    # a decimal comma in the answer reads as a point: (answer read, gold)
    assert forms.other_readings("1,5", "1.25") == [("1.5", "1.25")]
    # in the gold: (answer, gold read)
    assert forms.other_readings("1.25", "1,5") == [("1.25", "1.5")]
    # a gold percentage also reads without its sign when the answer has none
    assert forms.other_readings("25", "25\\%") == [("25", "25")]
    assert forms.other_readings("1,220", "1.22") == []  # a thousands separator


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("1,2", ["1", "2"]),
        ("(1, 2), [3, 4]", ["(1, 2)", " [3, 4]"]),
        ("\\frac{1,000}{2}, 3", ["\\frac{1,000}{2}", " 3"]),  # a comma inside braces stays
        ("{a, (b, c)}, d", ["{a, (b, c)}", " d"]),
    ],
)
def test_a_list_splits_at_its_top_level_commas_only(text: str, parts: list[str]) -> None:
    from codeloop.reward.fastpath import _split_top_level

    assert _split_top_level(text) == parts


def test_words_compare_without_case() -> None:
    assert equivalent("Monday", "monday") and equivalent("monday", "Monday")
    assert not equivalent("Tuesday", "monday")


@pytest.mark.parametrize(
    ("answer", "form"),
    [
        ("1^{(2^{235423523})}", "1"),  # not seconds of big-integer arithmetic
        ("-1^{2}", "-1"),
        ("\\frac{3}{1^{x+1}}", "\\frac{3}{1}"),
        ("1^{\\infty}", "1^{\\infty}"),  # indeterminate: left to the parser
        ("21^{2}", "21^{2}"),
        ("0.1^{2}", "0.1^{2}"),
        ("x_1^{2}", "x_1^{2}"),
        ("1^{2", "1^{2"),  # unbalanced
    ],
)
def test_a_power_of_one_is_one(answer: str, form: str) -> None:
    from codeloop.reward.forms import rewrite

    assert rewrite(answer) == form
