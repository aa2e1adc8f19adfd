"""Progress on long work: a tqdm bar on a terminal, plain lines anywhere else.

A bar redraws itself with carriage returns; written to a file (`make real > log`, CI) that is
one line of hundreds of updates. `progress_bar(...)` takes tqdm's arguments and returns a tqdm bar
when standard error is a terminal; otherwise an object with the same methods that prints one
plain line when the work starts, at most every `LINE_EVERY_S` seconds while it goes on, and
when it ends: `eval: 120/500 problems (reward=0.125)`. A transient bar (`leave=False`) prints
only when its work lasts `LINE_EVERY_S`, and then its end too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Any

from tqdm import tqdm

LINE_EVERY_S = 30.0


def progress_bar(iterable: Iterable[Any] | None = None, **options: Any) -> Any:
    """A tqdm bar on a terminal (or a disabled one), plain lines elsewhere; see the module
    docstring."""
    if options.get("disable") or sys.stderr.isatty():
        return tqdm(iterable, **options)
    return Lines(iterable, **options)


class Lines:
    """tqdm's interface (`update`, `set_postfix`, `refresh`, `close`, `n`, iteration, a
    context) printing plain lines to standard error."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: float | None = None,
        initial: float = 0,
        desc: str = "",
        *,
        unit: str = "it",
        leave: bool = True,
        **_ignored: Any,
    ) -> None:
        self.iterable = iterable
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.postfix = ""
        self._printed_at = float("-inf")
        self._last = ""
        self._closed = False
        self._with_postfix = False  # a caller that sets one right after each update
        self._due = False
        # a transient bar (leave=False: a step's rollout, say) prints only work that lasts
        self.leave, self._printed = leave, 0
        if leave:
            self._print()
        else:
            self._printed_at = time.monotonic()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._with_postfix:  # the line waits for the postfix of this update
            self._due = self._due or self._is_due()
        else:
            self.refresh()

    def set_postfix(self, **values: Any) -> None:
        self._with_postfix = True
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())
        if self._due:
            self._print()

    def refresh(self) -> None:
        """A line when the last one is `LINE_EVERY_S` old."""
        if self._is_due():
            self._print()

    def _is_due(self) -> bool:
        return time.monotonic() - self._printed_at >= LINE_EVERY_S

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.leave or self._printed:
                self._print()

    def _print(self) -> None:
        """The current line, unless it is the one printed last."""
        self._printed_at, self._due = time.monotonic(), False
        done = f"{self.n:g}" + (f"/{self.total:g}" if self.total is not None else "")
        head = f"{self.desc}: " if self.desc else ""
        tail = f" ({self.postfix})" if self.postfix else ""
        line = f"{head}{done} {self.unit}{tail}"
        if line != self._last:
            self._last, self._printed = line, self._printed + 1
            print(line, file=sys.stderr, flush=True)
