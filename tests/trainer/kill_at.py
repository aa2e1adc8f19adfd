"""`python kill_at.py POINT N ARGS...`: run `codeloop ARGS` and SIGKILL this process at the Nth
time it reaches POINT, as a preempted machine would:

- `rollout`: the engine samples a token for its running rows (mid-rollout);
- `update`: the learner starts an update (rollout done, the step not yet logged);
- `checkpoint`: a checkpoint's state file is written, before the checkpoint is renamed into place;
- `logged`: a step's metrics are written (the step not yet checkpointed when it is not due).
"""

import os
import signal
import sys
from typing import Any

import torch

from codeloop.cli import main
from codeloop.engine.hf_engine import TransformersEngine
from codeloop.trainer.learner import Learner
from codeloop.trainer.logs import RunLogger

POINTS: dict[str, tuple[Any, str, bool]] = {  # (owner, attribute, kill after the call returns)
    "rollout": (TransformersEngine, "_sample", False),
    "update": (Learner, "_update", False),
    "checkpoint": (torch, "save", True),
    "logged": (RunLogger, "log", True),
}


def kill_at(point: str, n: int) -> None:
    owner, name, after = POINTS[point]
    original = getattr(owner, name)
    calls = 0

    def patched(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, patched)


if __name__ == "__main__":
    kill_at(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
