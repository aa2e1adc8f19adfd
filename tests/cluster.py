"""A simulated cluster for tests: hosts in network namespaces on one bridge.

`Cluster(hosts)` makes a namespace holding a bridge (the switch) and one namespace per host,
each joined to the switch by a veth pair and given its own address (10.X.0.11, .12, ...); the
test's own process joins the switch too (10.X.0.1), so it can talk to the hosts, and nothing
else is touched: every address is inside namespaces the cluster made, X is chosen per cluster,
and deleting the namespaces removes every link. `start(host, argv)` runs a command on a host;
`kill(host)` kills everything that runs there (a crash); `cut(host)` / `restore(host)` take its
link down and up (a partition: packets vanish, nothing answers); `limit(host, kbit)` caps its
link's rate (`tc tbf`). `close()` (or the `with` block's end, also when a test fails) kills
every process and deletes every namespace. Needs root and iproute2; `unavailable()` says why
not otherwise.

This kernel has no `netem` qdisc, so delay, jitter and loss are not link properties here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_clusters_made = itertools.count()


def unavailable() -> str | None:
    """Why a cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def _free_subnet(start: int) -> int:
    """X in 100..199, from `start` on, with no 10.X.0.0/24 address in this namespace yet (a
    cluster of another test process running meanwhile has one)."""
    shown = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    taken = {int(part.split(".")[1]) for part in shown.split() if part.startswith("10.")}
    for offset in range(100):
        subnet = 100 + (start + offset) % 100
        if subnet not in taken:
            return subnet
    raise RuntimeError("no free 10.X.0.0/24 subnet between 10.100 and 10.199")


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


class Cluster:
    """See the module docstring."""

    def __init__(self, hosts: int) -> None:
        self.tag = f"cl{os.getpid() % 10000}x{time.monotonic_ns() % 1000}"
        self.net = f"{self.tag}-net"
        # 10.<subnet>.0.0/24, one per cluster: apart from other test processes' and this one's
        self.subnet = _free_subnet(os.getpid() + next(_clusters_made))
        self.hosts = [f"{self.tag}-h{i}" for i in range(1, hosts + 1)]
        self.processes: dict[str, list[subprocess.Popen[bytes]]] = {h: [] for h in self.hosts}
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def address(self, host: int) -> str:
        """The address of host `host` (1-based)."""
        return f"10.{self.subnet}.0.{10 + host}"

    @property
    def own_address(self) -> str:
        """The test process's address on the switch."""
        return f"10.{self.subnet}.0.1"

    def _build(self) -> None:
        _ip("netns", "add", self.net)
        self._made.append(self.net)
        _ip("link", "add", "br0", "type", "bridge", namespace=self.net)
        _ip("link", "set", "br0", "up", namespace=self.net)
        for index, host in enumerate(self.hosts, 1):
            _ip("netns", "add", host)
            self._made.append(host)
            self._plug(f"p{index}", "eth0", host, self.address(index))
        # the test's own process: a veth from the root namespace to the switch
        self._plug("p0", f"{self.tag}-r", None, self.own_address)

    def _plug(self, port: str, inside: str, host: str | None, address: str) -> None:
        """A veth pair: `port` on the switch, `inside` in `host` (None: the test's namespace)."""
        _ip(
            "link",
            "add",
            port,
            "netns",
            self.net,
            "type",
            "veth",
            "peer",
            "name",
            inside,
            *(["netns", host] if host else []),
        )
        _ip("link", "set", port, "master", "br0", namespace=self.net)
        _ip("link", "set", port, "up", namespace=self.net)
        _ip("addr", "add", f"{address}/24", "dev", inside, namespace=host)
        _ip("link", "set", inside, "up", namespace=host)
        if host:
            _ip("link", "set", "lo", "up", namespace=host)

    def start(
        self,
        host: int,
        argv: Sequence[str],
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Run `argv` on host `host` (its own process group, so `kill` takes its children)."""
        name = self.hosts[host - 1]
        out: Any = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child's
        process = subprocess.Popen(
            ["ip", "netns", "exec", name, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.processes[name].append(process)
        return process

    def kill(self, host: int) -> None:
        """Kill every process on host `host` (a crash): those started there, their process
        groups, and whatever else runs in its namespace (children in sessions of their own)."""
        name = self.hosts[host - 1]
        for process in self.processes[name]:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for process in self.processes[name]:
            process.wait()

    def cut(self, host: int) -> None:
        """Take host `host`'s link down: its packets vanish, nothing answers."""
        _ip("link", "set", f"p{host}", "down", namespace=self.net)

    def restore(self, host: int) -> None:
        _ip("link", "set", f"p{host}", "up", namespace=self.net)

    def limit(self, host: int, kbit: int) -> None:
        """Cap what host `host` receives from the switch to `kbit` kbit/s (`tc tbf`)."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.net,
                "tc",
                "qdisc",
                "replace",
                "dev",
                f"p{host}",
                "root",
                "tbf",
                "rate",
                f"{kbit}kbit",
                "burst",
                "16kbit",
                "latency",
                "400ms",
            ],
            check=True,
            capture_output=True,
        )

    def close(self) -> None:
        """Kill every process the cluster started and delete every namespace it made."""
        for index in range(1, len(self.hosts) + 1):
            self.kill(index)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_healthy(url: str, deadline_s: float = 300, context: ssl.SSLContext | None = None) -> None:
    """Wait until `url`'s `/health` answers (a server started on a host: a sandbox server or
    `codeloop serve`); `context` checks an `https://` server's certificate."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=30, context=context)
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up in {deadline_s:.0f} s") from None
            time.sleep(0.2)


def namespaces(prefix: str = "") -> set[str]:
    """The network namespaces that exist now whose names start with `prefix` (a cluster's
    `tag`: for checking that it left none, whatever other test processes run meanwhile)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return {name for name in names if name.startswith(prefix)}
