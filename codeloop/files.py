"""Writes that a crash never leaves half done: a file or a directory is whole or absent.

A run may be killed at any moment (SIGKILL, a preempted machine) and rerun; it decides what to
redo by what exists. So everything it later reads back is written beside its final name and
renamed into place (`os.replace` and a directory rename are atomic on one file system).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path`: readers see the old content or the new, never a part."""
    path = Path(path)
    partial = path.with_name(f".partial-{path.name}")
    partial.write_text(text)
    os.replace(partial, path)


@contextmanager
def directory_atomic(path: str | Path) -> Iterator[Path]:
    """Yield a scratch directory beside `path`; when the block ends without an error it becomes
    `path` (replacing what was there). Killed inside the block, `path` is unchanged and the
    scratch directory is removed by the next write of the same `path`."""
    path = Path(path)
    partial = path.with_name(f".partial-{path.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
