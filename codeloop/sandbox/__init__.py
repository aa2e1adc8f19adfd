"""Code execution for model-written Python: fast, isolated, never lost.

Parts: `executor` (what runs inside a child: notebook semantics, tracebacks, the trailer),
`isolation` (namespaces, private root, limits, uids), `zygote` (a single-threaded warm
interpreter that forks one child per call), `pool` (`WorkerPool` and `LocalSandbox`, the
in-process sandbox), `server` (the HTTP API), `client` (`SandboxClient`); its benchmark is
`codeloop/bench/sandbox.py`.

What each call is protected against, on a Linux host where the server runs as root (the
start-up report names every feature that is active and every one that is missing;
`--require-isolation` refuses to start with one missing):

- Network: the zygote lives in an empty network namespace (loopback only, down); a call
  cannot reach the host's loopback, the LAN or the internet.
- Host files: the zygote chroots into a private tmpfs root holding read-only bind mounts of
  only /usr, /lib*, /bin, /sbin, the Python installation and its site-packages, two files of
  /etc and four device nodes. No /proc, no /home or /root contents, no project directory, no
  training data: a policy cannot learn to read answers from disk.
- Writes: everything is read-only except the call's own fresh working directory (mode 0700,
  owned by the call's uid, removed afterwards); /tmp is root-owned 0711, so a call can neither
  list it nor enter another call's directory. The tmpfs is capped (512 MiB per worker).
- Other calls: each running call has a uid of its own (one per worker slot), so calls cannot
  signal, trace or read each other, and RLIMIT_NPROC is per call, not shared.
- Runaway code: a wall-clock deadline (soft SIGALRM, then SIGKILL 0.25 s later) kills the
  call's PID namespace, in which the call is PID 1, so every process it spawned dies with it,
  setsid() or not; CPU seconds, address space (on top of what the child inherits from the
  zygote, since RLIMIT_AS counts inherited mappings), processes, file size, open files and
  core dumps are limited, soft = hard, so user code cannot raise them.
- Privileges: uid/gid dropped, no supplementary groups, no_new_privs, PDEATHSIG.
- Secrets: zygotes are started with a clean exec and a five-variable environment; a child's
  environment is reset again; nothing of the server's environment block is inherited.
- Starvation: children run at nice 19 in a nice-19 autogroup (each call has its own session,
  and Linux weighs every session like one nice-0 task unless told otherwise), while the zygote's
  own session gets a high weight; so hundreds of spinning calls cannot stop the zygote from
  forking, enforcing deadlines and answering.
- The service: user code cannot kill a zygote or the server (other uid, other PID namespace);
  a zygote that dies anyway fails its calls in flight with `sandbox_error` and is replaced.

What it does not protect against: kernel exploits (there is no seccomp filter; the host
kernel is shared; run untrusted models at scale on disposable machines); timing side channels;
two calls running at the same time on one worker share the (empty) network namespace, so they
could talk over abstract Unix sockets (to each other, never to the host). As PID 1, a call
ignores signals it sends itself whose default action is to terminate (e.g.
`os.kill(os.getpid(), SIGTERM)`); its deadline still applies. Without root the server uses a
user namespace where it can, but calls share the server's uid (no per-call uid, shared
RLIMIT_NPROC) and no per-call PID namespace: the start-up report says so.
"""
