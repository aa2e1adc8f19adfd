"""`--help` for every command: descriptions as written, and each option's default after its help;
and the argument types every command shares (a count, a number of seconds), whose errors name the
option and the value in one line (argparse's usage error, exit 2).

`HelpFormatter` keeps a description's line breaks (module docstrings of the benchmarks), wraps a
one-paragraph description, and adds
`(default: X)` to an option's help where the default says something: not for flags, unset
options (`None`) or empty strings, and not where the help already names its default.
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """A description with line breaks (a module docstring) as written; one paragraph
        wrapped to the width."""
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        quiet = default is None or default is False or default == "" or default == []
        if quiet or default is argparse.SUPPRESS or "default" in text or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` with `HelpFormatter`; its sub-command parsers are of this class too."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def positive_count(text: str) -> int:
    """An option that counts something (requests, steps, sequences): 1 or more."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of 1 or more")
    return count


def count_or_zero(text: str) -> int:
    """A count where 0 turns something off: 0 or more."""
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of 0 or more")
    return count


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds
