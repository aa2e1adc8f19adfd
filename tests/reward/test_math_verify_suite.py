"""math-verify's own test suite, run against codeloop's reward.

The cases live in `codeloop/reward/math_verify_suite.json`, written from huggingface/Math-Verify
at a pinned commit by `tests/reward/import_math_verify_suite.py` (licence notice in the file).
Every case passes, or is listed in `agreement.OUT_OF_SCOPE` with why; a listed case that passes
fails here, so that the list is taken down when the reward learns the case.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from codeloop.reward import agreement
from codeloop.reward.verifier import Verifier

CASES, DOCUMENT = agreement.math_verify_suite()
IMPORTER = Path(__file__).with_name("import_math_verify_suite.py")


@pytest.fixture(scope="module")
def verdicts() -> dict[str, bool]:
    """codeloop's verdict on every case, scored once (a deadline no loaded machine reaches:
    a case must not flip on a timeout)."""
    cfg = dataclasses.replace(agreement.SUITE_REWARD, workers=2, deadline_s=120.0)
    with Verifier(cfg) as verifier:
        ours = agreement.our_verdicts(verifier, [c.case for c in CASES])
    return {c.id: o for c, o in zip(CASES, ours, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_case_of_math_verify_s_suite(
    case: agreement.SuiteCase, verdicts: dict[str, bool]
) -> None:
    reason = agreement.OUT_OF_SCOPE.get(case.id)
    if reason is None:
        assert verdicts[case.id] == case.expected, (case.gold, case.pred)
    else:
        assert verdicts[case.id] != case.expected, "passes now: take it out of OUT_OF_SCOPE"


def test_the_suite_is_math_verify_s_at_the_pinned_commit_with_its_notice() -> None:
    importer = IMPORTER.read_text()
    assert f'COMMIT = "{DOCUMENT["commit"]}"' in importer
    assert DOCUMENT["source"] == "huggingface/Math-Verify"
    assert "Apache License, Version 2.0" in DOCUMENT["notice"]
    assert DOCUMENT["commit"] in DOCUMENT["notice"]
    assert len(CASES) == 269
    assert len({c.id for c in CASES}) == len(CASES)
    assert set(agreement.OUT_OF_SCOPE) <= {c.id for c in CASES}
    assert len(agreement.OUT_OF_SCOPE) <= 29  # of 269: no case is added to the list quietly


def test_the_importer_rebuilds_the_cases_from_a_checkout(tmp_path: Path) -> None:
    """The importer reads a work tree; a fake one holding two of the suite's tests gives their
    cases with the options the tests pass."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_all.py").write_text(
        "import pytest, math\n"
        "@pytest.mark.parametrize('gold,pred,expected', [('$1$', '$1.0$', 1), "
        "(f'{math.sqrt(4):.1f}', '2', 1)])\n"
        "def test_number_extraction(gold, pred, expected):\n    pass\n"
        "@pytest.mark.parametrize('gold,pred,expected,precision', [('$1$', '$2$', 0, 3)])\n"
        "def test_complex_math_expressions(gold, pred, expected, precision):\n    pass\n"
    )
    for name in ("test_boxed", "test_numina_cases", "test_open_thoughts", "test_strict"):
        (tests / f"{name}.py").write_text("")
    (tests / "test_yujianll.py").write_text("")
    out = tmp_path / "suite.json"
    done = subprocess.run(
        [sys.executable, str(IMPORTER), str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "3 cases" in done.stdout
    cases = json.loads(out.read_text())["cases"]
    assert [(c["id"], c["gold"], c["pred"], c["expected"]) for c in cases] == [
        ("test_all.py::test_number_extraction[0]", "$1$", "$1.0$", True),
        ("test_all.py::test_number_extraction[1]", "2.0", "2", True),
        ("test_all.py::test_complex_math_expressions[0]", "$1$", "$2$", False),
    ]
    assert cases[0]["targets"] == ["expr"] and "precision" not in cases[0]
    assert cases[2]["targets"] == ["latex", "expr"] and cases[2]["precision"] == 3


def test_no_wrong_answer_is_accepted_on_an_integer_gold(verdicts: dict[str, bool]) -> None:
    """In scope or not, no case the suite calls wrong is right for codeloop when its gold is
    an integer."""
    wrong = [c for c in CASES if not c.expected and c.case.integer_gold]
    assert len(wrong) == 7  # `-[0,1)` and `Answer $ \n 9 \n $` for 1 and 9 among them
    assert [c.id for c in wrong if verdicts[c.id]] == []
