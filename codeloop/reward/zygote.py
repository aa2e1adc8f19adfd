"""The verifier zygote: `python -m codeloop.reward.zygote FD MEMORY_MB` (see `workers.py`).

Imports sympy and math-verify once, warms the parser, then forks one worker per byte read from
the control socket FD and sends back the worker's pid and its end of a socket pair. A worker
answers (pred, gold) with a bool until its socket closes; a gold that is a `TaskGold` is scored
by its reasoning-gym task (`task.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import resource
import signal
import socket
import sys
from multiprocessing.connection import Connection

from codeloop.reward.symbolic import equivalent
from codeloop.reward.task import TaskGold, task_score

# One of each answer shape: ANTLR learns its parsing decisions on first sight, ~10 ms each.
WARMUP = [
    ("0", "1"),
    (r"\frac{1}{3}", "0.5"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    (r"\frac{3\pi}{4}", r"\pi"),
    ("[1, 2)", r"(1, 2]"),
    (r"\{1, 2\}", r"\{2, 1\}"),
    ("(1, 2)", "(2, 1)"),
    ("x = 5", "5"),
    (r"1 \pm \sqrt{2}", r"1+\sqrt{2}, 1-\sqrt{2}"),
    (r"\text{yes}", r"\text{no}"),
    ("x^2 + 2x + 1", "(x+1)^2"),
    (r"(-\infty, 3] \cup (4, \infty)", r"x \le 3"),
]


def serve(conn: Connection, memory_mb: int) -> None:
    """Worker loop: (pred, gold) in, a bool out (None: a task's scorer raised), until the pipe
    closes."""
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            pred, gold = conn.recv()
        except (EOFError, ConnectionError):  # closed; or its owner died with a reply unread
            return
        try:
            same = task_score(pred, gold) if isinstance(gold, TaskGold) else equivalent(pred, gold)
        except Exception:  # a parser bug, MemoryError, RecursionError: not equal
            same = False
        try:
            conn.send(same)
        except ConnectionError:  # the owner is gone (our SIGKILL is on its way)
            return


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that
        os._exit(1)


def zygote(control: socket.socket, memory_mb: int, parent: int, gym: bool = False) -> None:
    """Fork one worker per byte received; send back its pid and its end of a socket pair.
    `parent`: the pid of the process that started it (the zygote and its workers die with it);
    `gym`: import reasoning-gym first (when installed), once for all the workers."""
    _die_with_parent(parent)
    if gym:
        with contextlib.suppress(ImportError):  # without it, each answer is unscorable
            import reasoning_gym  # noqa: F401
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": we own it
    for pred, gold in WARMUP:  # fill the parser's prediction cache once, shared by all workers
        equivalent(pred, gold)
    gc.freeze()  # keep the imported objects' pages shared with the workers
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps killed workers
    me = os.getpid()
    with contextlib.suppress(ConnectionError):  # the pool died: stop quietly
        _fork_on_request(control, memory_mb, me)


def _fork_on_request(control: socket.socket, memory_mb: int, me: int) -> None:
    """`zygote`'s loop: a worker for each byte received, until the control socket closes."""
    while control.recv(1):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            control.close()
            ours.close()
            _die_with_parent(me)
            serve(Connection(theirs.detach()), memory_mb)
            os._exit(0)
        theirs.close()
        socket.send_fds(control, [pid.to_bytes(8, "little")], [ours.fileno()])
        ours.close()


if __name__ == "__main__":
    fd, memory_mb, kind, parent = sys.argv[1:5]  # the parent's pid last, as the sandbox's
    zygote(socket.socket(fileno=int(fd)), int(memory_mb), int(parent), kind == "gym")
