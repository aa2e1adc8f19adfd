"""The tool semantics of `run_cell`, in-process (no fork, no isolation)."""

import pytest

from codeloop.sandbox.executor import compile_cell, run_cell


def _run(code: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, object], str, str]:
    trailer = run_cell(code, {"__name__": "__main__"})
    captured = capsys.readouterr()
    return trailer, captured.out, captured.err


def test_last_bare_expression_prints_its_repr(capsys: pytest.CaptureFixture[str]) -> None:
    trailer, out, _ = _run("x = 'a'\nx * 3", capsys)
    assert trailer == {"status": "ok", "error_type": None, "exit_code": 0}
    assert out == "'aaa'\n"


def test_none_and_statements_print_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("x = 1", capsys)[1] == ""
    assert _run("None", capsys)[1] == ""
    assert _run("print('hi')", capsys)[1] == "hi\n"  # print returns None: printed once


def test_only_the_last_statement_is_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("1 + 1\n2 + 2", capsys)[1] == "4\n"
    assert compile_cell("for i in range(2):\n    i")[1] is None  # last statement is a loop


def test_exception_gives_type_message_and_the_users_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trailer, out, err = _run("a = 1\nb = [0]\nprint(a / b[0])", capsys)
    assert trailer == {"status": "error", "error_type": "ZeroDivisionError", "exit_code": 1}
    assert out == ""
    assert 'File "<code>", line 3, in <module>' in err
    assert "print(a / b[0])" in err
    assert err.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "executor.py" not in err  # no frames of the sandbox itself


def test_traceback_through_user_functions(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = _run("def f(n):\n    return undefined_name + n\nf(1)", capsys)
    assert "line 3, in <module>" in err and "line 2, in f" in err
    assert "NameError: name 'undefined_name' is not defined" in err


def test_syntax_error_is_reported_without_sandbox_frames(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trailer, _, err = _run("x = (1,\nprint(x)", capsys)
    assert trailer["error_type"] == "SyntaxError"
    assert "Traceback" not in err and 'File "<code>"' in err


def test_sys_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("import sys; sys.exit(0)", capsys)[0]["status"] == "ok"
    assert _run("import sys; sys.exit()", capsys)[0]["status"] == "ok"
    assert _run("import sys; sys.exit(3)", capsys)[0] == {
        "status": "error",
        "error_type": "SystemExit",
        "exit_code": 3,
    }
    trailer, _, err = _run("import sys; sys.exit('bad input')", capsys)
    assert (trailer["exit_code"], err) == (1, "bad input\n")


def test_memory_error_has_its_own_status(capsys: pytest.CaptureFixture[str]) -> None:
    trailer, _, err = _run("raise MemoryError()", capsys)
    assert trailer["status"] == "memory"
    assert "MemoryError" in err
