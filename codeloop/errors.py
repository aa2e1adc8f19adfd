"""`CodeloopError`: the one base of every error codeloop raises about its input.

A bad config value, data file, model directory, conversation, server answer or host raises a
subclass (`ConfigError`, `DataError`, `ModelError`, `SFTDataError`, `EngineError`,
`IsolationError`, `PretrainedError`, `InputFileError`, `RunError`), whose message names the file,
line, field or URL. The
command line catches this one type: it prints the message and exits with status 2, never a
traceback. Each subclass also keeps the builtin base it had (`ValueError` or `RuntimeError`).
"""

from pathlib import Path


class CodeloopError(Exception):
    """Something about codeloop's input is wrong; the message says what and where."""


class InputFileError(CodeloopError, ValueError):
    """An input file that is not there, empty where content is needed, or not text."""


class ModelError(CodeloopError, ValueError):
    """A model (or its tokenizer and chat template) that cannot be loaded or used, with the path
    or name that failed."""


class RunError(CodeloopError, RuntimeError):
    """A run that cannot go on with its config and data (a refilter that keeps no problem, a
    step that finds too few groups with signal): the message says what to change."""


def read_text_input(path: str | Path, what: str) -> str:
    """The text of a user's input file, or an `InputFileError` naming `what` it is (a config
    key, say) and why it cannot be read: unset, missing, a directory, empty, not UTF-8 text."""
    if not str(path):
        raise InputFileError(f"{what}: not set (give a file)")
    file = Path(path)
    if file.is_dir():
        raise InputFileError(f"{what}: {path} is a directory; expected a file")
    if not file.is_file():
        raise InputFileError(f"{what}: {path}: no such file")
    try:
        text = file.read_text()
    except UnicodeDecodeError:
        raise InputFileError(f"{what}: {path} is not UTF-8 text") from None
    if not text.strip():
        raise InputFileError(f"{what}: {path} is empty")
    return text
