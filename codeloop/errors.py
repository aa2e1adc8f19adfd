"""`CodeloopError`: the one base of every error codeloop raises about its input.

A bad config value, data file, model directory, conversation, server answer or host raises a
subclass (`ConfigError`, `DataError`, `ModelError`, `SFTDataError`, `EngineError`,
`IsolationError`, `PretrainedError`), whose message names the file, line, field or URL. The
command line catches this one type: it prints the message and exits with status 2, never a
traceback. Each subclass also keeps the builtin base it had (`ValueError` or `RuntimeError`).
"""


class CodeloopError(Exception):
    """Something about codeloop's input is wrong; the message says what and where."""
