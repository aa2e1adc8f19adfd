"""The suite's own hygiene: a pytest mark sits on a test, where it acts, not on a helper."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _marked_helpers() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            marks = [d for d in node.decorator_list if "pytest.mark" in ast.unparse(d)]
            if marks and not node.name.startswith("test"):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno} {node.name}")
    return found


def test_marks_are_on_tests_only() -> None:
    assert _marked_helpers() == []
