"""A whole RL run on a simulated cluster (`tests/cluster.py`), and the network's faults during it.

Seven hosts, each a network namespace with its own address: two trainer nodes (`torchrun`, one
gloo process each, rendezvousing at the first node's address), two inference servers
(`codeloop serve`, `rollout.backend = "openai"`) and three sandbox servers behind the client.
The inference servers run in a mount namespace of their own where the trainer's directory is
an empty tmpfs, so the weights they receive after each step can only have come over the
network.

The same run with every process on one host logs the same metrics: the servers decode one
request at a time (`--max-batch 1`), every trajectory samples with its own seed, the sandbox
prints what the code computes and gloo reduces in a fixed order, so which server or sandbox
host serves a call changes nothing but timings. Rewards, token and tool-call counts must be
equal; losses and gradient norms agree to float rounding (a turn whose earlier context was
cached on one server is prefilled whole on another, which rounds differently), and timings,
engine counters and the servers' queues differ.

A slow lossy link and a trainer node lost have a test each; the other faults (sandbox hosts
killed or cut off, an inference server restarted) come together in one run, with a trainer node
lost too, as a storm. Each run must end with every step logged once, the last checkpoint
loadable, no tool call lost or reported to the model as its own error, and nothing left running.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import transformers
from certs import self_signed
from cluster import Cluster, namespaces, unavailable, wait_healthy
from trainer_helpers import conversation

from codeloop.config import SFTConfig
from codeloop.engine.model import tiny_model
from codeloop.rollout.prompt import PromptFormat
from codeloop.trainer.logs import read_metrics
from codeloop.trainer.sft import train_sft

why_not = unavailable() or (None if shutil.which("unshare") else "util-linux unshare is missing")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not is not None, reason=str(why_not))]

PAIRS = [(1, 2), (3, 4), (10, 20), (7, 8)]
EQUAL = ["reward/mean", "rollout/response_tokens", "rollout/tool_calls", "rollout/groups_kept"]
CLOSE = ["loss/loss", "loss/grad_norm", "loss/lr"]
MASTER_PORT = 29500


@dataclass
class Layout:
    """Which host runs what (1-based), and the ports, so that one host can hold everything."""

    trainers: tuple[int, int] = (1, 2)
    inference: tuple[int, ...] = (3, 4)
    sandboxes: tuple[int, ...] = (5, 6, 7)
    inference_ports: tuple[int, ...] = (8000, 8000)
    sandbox_ports: tuple[int, ...] = (8800, 8800, 8800)

    @property
    def hosts(self) -> int:
        return max(*self.trainers, *self.inference, *self.sandboxes)


ONE_HOST = Layout((1, 1), (1, 1), (1, 1, 1), (8000, 8001), (8800, 8801, 8802))


@dataclass
class ClusterRun:
    """An RL run's processes on `cluster` as `layout` places them; files under `root`."""

    cluster: Cluster
    root: Path
    layout: Layout
    steps: int
    trainers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    again: bool = False  # the trainers were started a second time (their logs apart)
    tls: tuple[Path, Path] | None = None  # (certificate, key): the servers serve https

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def context(self) -> ssl.SSLContext | None:
        """What checks the servers' certificate, for the test's own requests."""
        return ssl.create_default_context(cafile=self.tls[0]) if self.tls else None

    def served(self, url: str, pattern: str) -> int:
        return served(url, pattern, self.context)

    def health(self, url: str) -> dict[str, Any]:
        opened = urllib.request.urlopen(url + "/health", timeout=30, context=self.context)
        return dict(json.loads(opened.read()))

    def tls_flags(self) -> list[str]:
        return ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])] if self.tls else []

    @property
    def run_dir(self) -> Path:
        return self.root / "trainer" / "run"

    def inference_urls(self) -> list[str]:
        pairs = zip(self.layout.inference, self.layout.inference_ports, strict=True)
        return [f"{self.scheme}://{self.cluster.address(h)}:{p}" for h, p in pairs]

    def sandbox_urls(self) -> list[str]:
        pairs = zip(self.layout.sandboxes, self.layout.sandbox_ports, strict=True)
        return [f"{self.scheme}://{self.cluster.address(h)}:{p}" for h, p in pairs]

    def start_sandbox(self, index: int) -> None:
        host, port = self.layout.sandboxes[index], self.layout.sandbox_ports[index]
        self.cluster.start(
            host,
            [
                sys.executable,
                "-m",
                "codeloop",
                "sandbox",
                "serve",
                "--host",
                self.cluster.address(host),
                "--insecure-no-token",
                "--port",
                str(port),
                "--workers",
                "2",
                *self.tls_flags(),
            ],
            log=self.root / f"sandbox{index}.log",
        )

    def start_inference(self, index: int) -> None:
        """`codeloop serve` where the trainer's directory is an empty tmpfs."""
        host, port = self.layout.inference[index], self.layout.inference_ports[index]
        serve = (
            f"exec {sys.executable} -m codeloop serve --model {self.root / 'served'} "
            f"--host {self.cluster.address(host)} --port {port} --max-batch 1 --insecure-no-token "
            + " ".join(self.tls_flags())
        )
        self.cluster.start(
            host, hidden_from_trainer(self.root, serve), log=self.root / f"inference{index}.log"
        )

    def start_services(self) -> None:
        for index in range(len(self.layout.sandboxes)):
            self.start_sandbox(index)
        for index in range(len(self.layout.inference)):
            self.start_inference(index)
        for url in [*self.sandbox_urls(), *self.inference_urls()]:
            wait_healthy(url, context=self.context)

    def start_trainers(self, again: bool = False, unshared: bool = False) -> None:
        """Both trainer nodes; `again`: their logs apart from the first start's; `unshared`:
        the second node does not see the run directory (no shared filesystem)."""
        config = self.root / "trainer" / "run.toml"
        text = run_config(self.root, self.inference_urls(), self.sandbox_urls(), self.steps)
        if self.tls:  # the certificate the clients check the servers against
            text = text.replace("[sandbox]", f'[sandbox]\nca_file = "{self.tls[0]}"')
            text = text.replace("[rollout]", f'[rollout]\nserver_ca_file = "{self.tls[0]}"')
        config.write_text(text)
        master = self.cluster.address(self.layout.trainers[0])
        self.again = again
        self.trainers = []
        for rank, host in enumerate(self.layout.trainers):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                master,
                "--master-port",
                str(MASTER_PORT),
                "-m",
                "codeloop",
                "train",
                "--config",
                str(config),
            ]
            log = self.root / f"trainer{rank}{'.again' if again else ''}.log"
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
            if unshared and rank == 1:
                command = hidden(self.run_dir, " ".join(command))
            self.trainers.append(self.cluster.start(host, command, log=log, env=env))

    def wait_trainers(self, timeout_s: float = 300) -> list[int]:
        end = time.monotonic() + timeout_s
        codes = []
        for process in self.trainers:
            codes.append(process.wait(max(1.0, end - time.monotonic())))
        return codes

    def log(self, name: str) -> str:
        if name.startswith("trainer") and self.again:
            name += ".again"
        return (self.root / f"{name}.log").read_text(errors="replace")

    def check_finished(self) -> list[dict[str, Any]]:
        """What every run must end with; returns the logged metrics."""
        codes = self.wait_trainers()
        assert codes == [0, 0], self.log("trainer0")[-3000:] + self.log("trainer1")[-3000:]
        metrics = read_metrics(self.run_dir)
        assert [m["step"] for m in metrics] == list(range(1, self.steps + 1))  # each step once
        last = self.run_dir / "checkpoints" / f"step_{self.steps:06d}" / "model"
        transformers.AutoModelForCausalLM.from_pretrained(last)  # loadable
        every: set[str] = set()
        for step in range(1, self.steps + 1):  # every call answered, none a sandbox fault
            dump = (self.run_dir / "trajectories" / f"step_{step:06d}.jsonl").read_text()
            records = [r for line in dump.splitlines() for r in json.loads(line)["tool_calls"]]
            statuses = {r["result"]["status"] for r in records if r["call"] is not None}
            assert "sandbox_error" not in statuses, (step, statuses)
            ends = {json.loads(line)["status"] for line in dump.splitlines()}
            assert "error" not in ends, (step, ends)  # no trajectory lost to a server
            every |= statuses
        assert "ok" in every  # the policy did call its tool
        return metrics


COMPLETED = r"^codeloop_engine_requests_completed_total (\d+)"
SANDBOX_CALLS = r'^sandbox_calls_total\{status="\w+"\} (\d+)'


def served(url: str, pattern: str, context: ssl.SSLContext | None = None) -> int:
    """What a server's /metrics counts: requests completed, or sandbox calls."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30, context=context).read().decode()
    return sum(int(n) for n in re.findall(pattern, text, re.M))


def wait_for(what: str, ready: Any, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def hidden_from_trainer(root: Path, command: str) -> list[str]:
    """`command` in a mount namespace where the trainer's directory is an empty tmpfs."""
    return hidden(root / "trainer", command)


def hidden(directory: Path, command: str) -> list[str]:
    """`command` (a shell line) in a mount namespace where `directory` is an empty tmpfs."""
    return ["unshare", "--mount", "sh", "-c", f"mount -t tmpfs hidden {directory} && {command}"]


def run_config(root: Path, inference: list[str], sandboxes: list[str], steps: int) -> str:
    return f"""
[trainer]
model = "{root / "trainer" / "policy"}"
output_dir = "{root / "trainer" / "run"}"
prompts_per_step = 2
max_steps = {steps}
checkpoint_every = 1
lr = 1e-3
warmup_steps = 0
micro_batch_tokens = 4096
[data]
train = "{root / "trainer" / "problems.jsonl"}"
[algo]
group_size = 2
drop_zero_signal_groups = false
[rollout]
backend = "openai"
endpoints = {json.dumps(inference)}
max_response_tokens = 200
max_turns = 3
temperature = 0.7
server_retry_s = 60
[sandbox]
urls = {json.dumps(sandboxes)}
client_connect_timeout_s = 1.0
[reward]
workers = 1
"""


@pytest.fixture(scope="module")
def policy(trainer_fmt: PromptFormat, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy that has learnt the tool format on PAIRS (not perfectly), saved."""
    fmt, saved = trainer_fmt, tmp_path_factory.mktemp("policy")
    model = tiny_model(len(fmt.tokenizer), hidden_size=64, layers=2)
    data = [conversation(fmt, a, b) for a, b in PAIRS]
    train_sft(
        model, fmt, data, SFTConfig(epochs=60, lr=1e-2, warmup_steps=5, conversations_per_step=4)
    )
    model.save_pretrained(saved)
    fmt.tokenizer.save_pretrained(saved)
    return saved


def prepare(root: Path, policy: Path) -> None:
    """The trainer's files (hidden from the servers) and the servers' own copy of the policy."""
    (root / "trainer").mkdir(parents=True)
    shutil.copytree(policy, root / "trainer" / "policy")
    shutil.copytree(policy, root / "served")
    rows = [
        {"id": f"p{i}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
        for i, (a, b) in enumerate(PAIRS)
    ]
    (root / "trainer" / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def cluster_run(policy: Path, tmp_path: Path) -> Iterator[ClusterRun]:
    """The services of a 3-step run up on seven hosts; the test starts the trainers."""
    yield from _cluster_run(policy, tmp_path, tls=False)


@pytest.fixture
def tls_cluster_run(policy: Path, tmp_path: Path) -> Iterator[ClusterRun]:
    """`cluster_run` with every server on https, its certificate self-signed for the hosts."""
    yield from _cluster_run(policy, tmp_path, tls=True)


def _cluster_run(policy: Path, root: Path, tls: bool) -> Iterator[ClusterRun]:
    prepare(root, policy)
    with Cluster(7) as cluster:
        run = ClusterRun(cluster, root, Layout(), steps=3)
        if tls:
            (root / "tls").mkdir()
            run.tls = self_signed(root / "tls", [cluster.address(h) for h in range(1, 8)])
        run.start_services()
        yield run
        processes = [p for started in cluster.processes.values() for p in started]
    assert all(p.poll() is not None for p in processes)  # nothing left running
    assert namespaces(cluster.tag) == set()


def test_the_servers_cannot_see_the_trainers_files(cluster_run: ClusterRun) -> None:
    policy = cluster_run.root / "trainer" / "policy" / "config.json"
    command = hidden_from_trainer(cluster_run.root, f"test -e {policy}")
    assert (
        subprocess.run(["ip", "netns", "exec", cluster_run.cluster.hosts[2], *command]).returncode
        == 1
    )
    assert policy.is_file()  # the trainer sees it


def test_a_run_across_seven_hosts_logs_what_the_same_run_on_one_host_logs(
    cluster_run: ClusterRun, policy: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cluster_run.start_trainers()
    spread = cluster_run.check_finished()
    assert all(served(url, COMPLETED) > 0 for url in cluster_run.inference_urls())
    # The client gives equal servers their turn, so the first three batches of the run reach
    # three different servers, however the calls are timed.
    assert all(served(url, SANDBOX_CALLS) > 0 for url in cluster_run.sandbox_urls())
    for url in cluster_run.inference_urls():  # both servers hold the last step's weights
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
        assert health["version"] == cluster_run.steps
    assert "weights" not in {p.name for p in cluster_run.run_dir.iterdir()}  # none through files

    root = tmp_path_factory.mktemp("one_host")
    prepare(root, policy)
    with Cluster(1) as cluster:
        alone = ClusterRun(cluster, root, ONE_HOST, steps=3)
        alone.start_services()
        alone.start_trainers()
        together = alone.check_finished()
    for a, b in zip(spread, together, strict=True):
        assert {k: a[k] for k in EQUAL} == {k: b[k] for k in EQUAL}
        assert {k: a[k] for k in CLOSE} == pytest.approx({k: b[k] for k in CLOSE}, rel=1e-4)


def test_a_slow_lossy_sandbox_link_slows_the_run_and_loses_nothing(cluster_run: ClusterRun) -> None:
    from faultproxy import FaultProxy

    run = cluster_run
    host, port = run.layout.sandboxes[2], run.layout.sandbox_ports[2]
    loop = asyncio.new_event_loop()
    proxy = FaultProxy(
        run.cluster.own_address, run.cluster.address(host), port, delay_s=0.2, loss=0.05, seed=1
    )
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    slow = asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    urls = run.sandbox_urls
    run.sandbox_urls = lambda: [*urls()[:2], f"http://{slow}"]  # type: ignore[method-assign]
    try:
        run.start_trainers()
        run.check_finished()
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    # calls went over the bad link (each chunk delayed; about one in twenty held longer, which
    # a short run's few dozen chunks may or may not meet)
    assert proxy.connections > 0 and served(urls()[2], SANDBOX_CALLS) > 0


def test_a_trainer_node_killed_stops_the_run_and_a_restart_resumes(
    cluster_run: ClusterRun,
) -> None:
    run = cluster_run
    run.steps = 12  # the kill lands mid-run
    run.start_trainers()
    saved = run.run_dir / "checkpoints" / "step_000002"  # renamed into place once complete
    wait_for("the second checkpoint", saved.is_dir)
    run.cluster.kill(run.layout.trainers[1])
    code = run.trainers[0].wait(120)
    said = run.log("trainer0")
    assert code != 0
    node = run.cluster.address(run.layout.trainers[1])
    assert f"lost trainer rank 1 ({node})" in said, said[-3000:]
    # restarted where the second node does not see the run directory: refused, and why
    run.start_trainers(unshared=True)
    assert run.wait_trainers() != [0, 0]
    said = run.log("trainer0")
    assert f"rank 1 ({node}): no checkpoint" in said and "a shared filesystem" in said, said
    run.start_trainers(again=True)  # the same command on both nodes again
    run.check_finished()
    assert re.search(r"resumed from step ([2-9]|1[01])\b", run.log("trainer0"))


def test_a_storm_of_overlapping_faults_over_tls(tls_cluster_run: ClusterRun) -> None:
    """One run of 24 steps, every server on https, under a seeded schedule of faults that
    overlap: a trainer node lost and the run restarted, two sandbox hosts down at once, a
    sandbox link cut while an inference server restarts, a sandbox host that comes back and
    goes again. Each fault waits for the run to reach a step, not for a time, and a wait for
    the run to use a host ends early when the run is over, so what is asserted holds at any
    speed: the ends of `check_finished`, both servers on the last weights, and the fixture's
    (nothing left running, no namespace left)."""
    run = tls_cluster_run
    run.steps = 24
    rng = random.Random(52)
    down, cut = rng.sample(range(3), 2), rng.randrange(3)
    sandbox = {i: (run.layout.sandboxes[i], run.sandbox_urls()[i]) for i in range(3)}
    said: list[str] = []

    def reached(step: int) -> bool:  # logged (a resumed run logs again from its checkpoint)
        return any(m["step"] >= step for m in read_metrics(run.run_dir))

    def running() -> bool:
        return any(p.poll() is None for p in run.trainers)

    def until(what: str, ready: Any) -> None:
        """Wait for `ready`, or for the run to end (then the fault lands after the run)."""
        wait_for(what, lambda: ready() or not running(), timeout_s=300)
        said.append(what if ready() else f"{what}: the run had ended")

    run.start_trainers()
    # a trainer node lost: the run stops; the same command on both nodes resumes it
    saved = run.run_dir / "checkpoints" / "step_000002"  # renamed into place once complete
    until("the second checkpoint", saved.is_dir)
    run.cluster.kill(run.layout.trainers[1])
    assert run.trainers[0].wait(120) != 0
    run.start_trainers(again=True)
    # two sandbox hosts down at once: the third carries the calls; both come back
    until("the resumed run's first new step", lambda: reached(3))
    for index in down:
        run.cluster.kill(sandbox[index][0])
    carrier = sandbox[({0, 1, 2} - set(down)).pop()][1]
    before = run.served(carrier, SANDBOX_CALLS)
    until("calls on the one sandbox host left", lambda: run.served(carrier, SANDBOX_CALLS) > before)
    for index in down:
        run.start_sandbox(index)
    for index in down:
        wait_healthy(sandbox[index][1], context=run.context)
    # a sandbox link cut while an inference server restarts
    until("step 8", lambda: reached(8))
    run.cluster.cut(sandbox[cut][0])
    run.cluster.kill(run.layout.inference[0])
    run.start_inference(0)
    wait_healthy(run.inference_urls()[0], context=run.context)
    run.cluster.restore(sandbox[cut][0])
    # a host that comes back and goes again
    host, url = sandbox[down[0]]
    until("step 12", lambda: reached(12))
    run.cluster.cut(host)
    time.sleep(3)
    run.cluster.restore(host)
    back = run.served(url, SANDBOX_CALLS)
    until("the host to serve again", lambda: run.served(url, SANDBOX_CALLS) > back)
    run.cluster.cut(host)
    time.sleep(3)
    run.cluster.restore(host)

    run.check_finished()
    for server in run.inference_urls():  # both on the last step's weights
        assert run.health(server)["version"] == run.steps, (server, said)
    assert re.search(r"resumed from step [2-4]\b", run.log("trainer0")), said
