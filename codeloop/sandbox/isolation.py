"""Linux isolation primitives for the sandbox zygote and its children.

The zygote calls `enter_sandbox_root` once at start-up: a private mount namespace whose root is
a fresh tmpfs holding read-only bind mounts of only what the interpreter needs (system
libraries, the Python installation and its site-packages, a few device nodes), plus an empty
network namespace (loopback only, down). Each child then gets, from `prepare_child`: a new PID
namespace (it is PID 1, so everything it spawns dies with it), a new session, resource limits,
an unprivileged uid of its own, and no_new_privs.

What each feature protects against, and what it does not, is written in `sandbox/__init__.py`.
Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal
import sys
from dataclasses import dataclass, field

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

# Host paths the interpreter may need, read-only; the Python installation is added at runtime.
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
ROOT = "/tmp/codeloop-root"  # inside the zygote's private mount namespace only

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, *, data: str = ""
) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl")


@dataclass
class IsolationReport:
    """Which isolation features are active; a missing one carries the reason."""

    active: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)

    def add(self, feature: str, error: str | None) -> None:
        if error is None:
            self.active.append(feature)
        else:
            self.missing[feature] = error

    def to_dict(self) -> dict[str, object]:
        return {"active": self.active, "missing": self.missing}


@dataclass
class SandboxRoot:
    """What the zygote learned while building its root; used for every child."""

    report: IsolationReport
    pidns_fd: int | None  # our own PID namespace, to reset pid_for_children before each fork
    proc_fd: int | None  # the host's /proc, opened before the chroot (see lower_autogroup)
    can_setuid: bool
    scratch: str  # directory for per-call working directories


def python_paths() -> list[str]:
    """The Python installation directories the sandbox root mounts read-only."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = set(prefixes)
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if os.path.isdir(real) and any(real.startswith(p + os.sep) for p in prefixes):
            paths.add(real)
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(paths)


def _bind_readonly(source: str, target_root: str) -> None:
    target = target_root + source
    if os.path.islink(source):  # merged-/usr systems: /lib -> usr/lib
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _covered(path: str, mounted: list[str]) -> bool:
    return any(path == m or path.startswith(m + os.sep) for m in mounted)


def _build_root(tmpfs_mb: int) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    os.makedirs(ROOT, exist_ok=True)
    mount("tmpfs", ROOT, "tmpfs", MS_NOSUID | MS_NODEV, data=f"size={tmpfs_mb}m,mode=755")
    mounted: list[str] = []
    for path in [*SYSTEM_PATHS, *python_paths(), *ETC_FILES, *DEVICES]:
        if os.path.islink(path) or (os.path.exists(path) and not _covered(path, mounted)):
            _bind_readonly(path, ROOT)
            mounted.append(os.path.realpath(path))
    os.makedirs(ROOT + "/tmp", mode=0o711, exist_ok=True)
    os.chmod(ROOT + "/tmp", 0o711)  # children may enter their own directory, not list or write


def _enter_user_namespace() -> None:
    """Without root: become root of a new user namespace mapped onto our own uid/gid."""
    uid, gid = os.geteuid(), os.getegid()
    unshare(CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as fh:
        fh.write("deny")
    with open("/proc/self/uid_map", "w") as fh:
        fh.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as fh:
        fh.write(f"0 {gid} 1")


def enter_sandbox_root(tmpfs_mb: int = 256) -> SandboxRoot:
    """Isolate the calling (single-threaded) zygote; report every feature, skip none silently."""
    report = IsolationReport()
    was_root = os.geteuid() == 0
    pidns_fd: int | None = os.open("/proc/self/ns/pid", os.O_RDONLY)  # before /proc disappears
    proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    raise_own_autogroup(proc_fd)
    if not was_root:
        try:
            _enter_user_namespace()
            report.add("user_namespace", None)
        except OSError as err:
            report.add("user_namespace", str(err))
    try:
        unshare(CLONE_NEWNET)
        report.add("network_namespace", None)
    except OSError as err:
        report.add("network_namespace", str(err))
    scratch = "/tmp"
    try:
        unshare(CLONE_NEWNS)
        _build_root(tmpfs_mb)
        os.chroot(ROOT)
        os.chdir("/")
        report.add("private_filesystem", None)
    except OSError as err:
        report.add("private_filesystem", str(err))
        import tempfile  # only on this degraded path

        scratch = tempfile.mkdtemp(prefix="codeloop-sandbox-")
    try:
        assert pidns_fd is not None
        unshare(CLONE_NEWPID)
        setns(pidns_fd, CLONE_NEWPID)  # proves the per-fork reset works here
        report.add("pid_namespace", None)
    except OSError as err:
        report.add("pid_namespace", str(err))
        pidns_fd = None
    report.add("unprivileged_uid", None if was_root else "not root: calls share the server's uid")
    report.add("resource_limits", None)
    return SandboxRoot(report, pidns_fd, proc_fd, was_root, scratch)


def new_pid_namespace_for_next_child(root: SandboxRoot) -> None:
    """The next fork becomes PID 1 of a fresh namespace (reset first: one unshare per fork)."""
    if root.pidns_fd is not None:
        setns(root.pidns_fd, CLONE_NEWPID)
        unshare(CLONE_NEWPID)


@dataclass(frozen=True)
class Limits:
    cpu_s: int
    address_space_bytes: int
    processes: int = 64
    file_size_bytes: int = 16 << 20
    open_files: int = 64


def apply_limits(limits: Limits) -> None:
    """Soft = hard everywhere, so user code cannot raise them back."""
    pairs = [
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.address_space_bytes),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def drop_privileges(uid: int) -> None:
    """Become `uid` (no groups, no way back, no new privileges)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def no_new_privs_and_die_with_parent() -> None:
    die_with_parent()
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def die_with_parent() -> None:
    """SIGKILL when the parent dies. The kernel forgets this request when the process's
    credentials change (setresuid, setresgid): make it again after dropping privileges."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _write_autogroup(proc_fd: int, path: str, nice: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY, dir_fd=proc_fd)
    except FileNotFoundError:  # kernel without autogroups, or the process is gone
        return
    try:
        os.write(fd, str(nice).encode())
    except OSError:  # the process exited meanwhile
        pass
    finally:
        os.close(fd)


def lower_autogroup(proc_fd: int | None) -> None:
    """Give the session just created by setsid() the lowest CPU weight.

    With scheduler autogroups (Linux's default) every session is its own CPU group weighted like
    one nice-0 task, whatever the nice value or policy of the tasks inside. 128 spinning
    sessions then outweigh the zygote 128 to 1 and one fork takes ~240 ms instead of ~3 ms.
    """
    if proc_fd is not None:
        _write_autogroup(proc_fd, "self/autogroup", 19)


def raise_own_autogroup(proc_fd: int) -> None:
    """The zygote's own session gets a high CPU weight (root only): its work is bounded — fork,
    read pipes, kill at deadlines — and must not wait behind hundreds of spinning children."""
    os.setsid()
    _write_autogroup(proc_fd, "self/autogroup", -10 if os.geteuid() == 0 else 0)


def restore_priority(proc_fd: int | None, pid: int) -> None:
    """Before a SIGKILL: a killed task must be scheduled to exit, so lift it out of nice 19."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 0)
    except OSError:  # not root, or already gone
        pass
    if proc_fd is not None:
        _write_autogroup(proc_fd, f"{pid}/autogroup", 0)
