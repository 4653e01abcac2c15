"""A simulated multi-machine Ray cluster on loopback, for tests (root only).

API (small on purpose; the Ray launcher's tests build on it)::

    cluster = SimulatedCluster().start()   # blocks until every node is alive in the GCS
                                           # (one retry in a fresh namespace if a start fails)
    cluster.address                        # "127.0.0.1:6379" (reachable only inside)
    cluster.client_address                 # "ray://127.0.0.1:10001": the head's Ray Client server
    cluster.gpu_node_ips, cluster.cpu_node_ips   # ("127.0.1.1", "127.0.1.2"), ("127.0.2.1",)
    cluster.run(argv, cwd=..., auth=True, **subprocess_run_kwargs)  # a command inside; CompletedProcess
    cluster.popen(argv, cwd=..., **popen_kwargs)         # the same, not waited for
    cluster.command(argv, cwd=..., auth=True)  # the argv that runs ``argv`` inside (nsenter + argv)
    cluster.auth_env                       # RAY_AUTH_MODE=token and the token's path
    cluster.kernel(cwd, env=None, load_taas=True)  # a tests.support.kernel_driver.Kernel running inside
    cluster.processes()                    # every process inside, as psutil.Process (outer pids)
    cluster.stop()                         # SIGKILL of the namespace's init: everything ends

The layout: a head (127.0.0.1, port 6379, no CPUs: it only coordinates, like a real head),
``gpu_nodes`` "GPU" nodes at 127.0.1.x (``--num-gpus 2``, resource ``gpu_node: 1``, 2 CPUs) and
``cpu_nodes`` CPU nodes at 127.0.2.x (2 CPUs, resource ``cpu_node: 1``).  The head also runs
the Ray Client server (``client_address``), for kernels that connect with ``ray://``.  No node
has a real GPU: ``num_gpus`` is a scheduling label (Ray sets CUDA_VISIBLE_DEVICES in tasks that
ask for GPUs).  Each node has its own temp dir (nodes sharing one print each log line once per
node, tagged with the wrong IP) and a 300 MB object store (each would otherwise claim the
machine's memory).

Why a private network and PID namespace (``unshare --net --pid --fork --mount-proc``): on the
host Ray binds its non-loopback address whatever it is told; inside a namespace that has only
``lo`` it cannot, and several nodes can each have their own 127.x address (lo holds 127/8).
PID 1 of the namespace is tests/support/cluster_init.py: it starts the nodes, reaps orphans, and its
death (``stop()``, or the test process dying: it exits when its stdin closes, and unshare has
a parent-death signal that makes it kill the init) makes the kernel
kill every process inside.  ``ray stop`` is never needed, and must never run outside such a
namespace (it kills every Ray process on the machine by name).

The cluster runs with Ray's token authentication (``RAY_AUTH_MODE=token``), as a production
cluster should: a random token in a file only its owner can read (``base/auth_token``, mode
0600), named by ``RAY_AUTH_TOKEN_PATH``.  Every process put inside gets both variables (so the
user's ``~/.ray/auth_token`` is never read or written; Ray >= 2.59 otherwise turns token mode on
for a head whenever that file exists, and nodes started without it cannot join).

Processes are put inside with ``nsenter --target INIT --net --pid --mount``: they see only
loopback and the cluster.  A process outside (the test itself) cannot reach the cluster's
ports (a different network namespace), but shares the filesystem: a kernel inside talks to its
outside client over jupyter_client's IPC transport (Unix sockets next to its connection file).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import psutil

HEAD_IP = "127.0.0.1"
PORT = 6379
# The head's Ray Client server (``ray://``; it needs ray[client]'s grpcio): `ray start --head`'s
# default port with ray[client] installed, named so that the harness does not rely on it.
CLIENT_PORT = 10001

# Upper bound for the whole start (head, then nodes in parallel, then all alive): measured
# 10-45 s on 2 busy cores; only a broken cluster reaches this.
START_TIMEOUT = 600.0

_INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_init.py")


def missing_namespaces() -> str | None:
    """Why Ray cannot be run in a private network and PID namespace here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network and PID namespaces: unshare --net --pid)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    return None


def missing_requirements() -> str | None:
    """Why a simulated cluster cannot run here (None: it can) — for a test's skip reason."""
    reason = missing_namespaces()
    if reason:
        return reason
    if _ray_executable() is None:
        return "needs ray (pip install ray), with its `ray` command next to this python"
    try:
        import ray  # noqa: F401  (only whether it imports)
    except ImportError as e:
        return f"needs ray importable: {e}"
    try:
        import grpc  # noqa: F401  (the head's Ray Client server needs it)
    except ImportError:
        return "needs ray[client] (pip install 'ray[client]'): the head runs a Ray Client server"
    return None


def _ray_executable() -> str | None:
    """The ``ray`` command of this interpreter's environment (not whichever is first on PATH)."""
    candidate = os.path.join(os.path.dirname(sys.executable), "ray")
    return candidate if os.access(candidate, os.X_OK) else shutil.which("ray")


def _die_with_parent() -> None:
    """In unshare, before it execs: SIGKILL when the thread that started it ends (a test
    session killed outright).  unshare's ``--kill-child`` then kills the init, and with it the
    namespace.  Belt and braces with the init's end-of-stdin rule: a process forked (not
    exec'd) by the owner could hold that pipe open."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def write_auth_token(directory: str) -> dict[str, str]:
    """A fresh Ray auth token in ``directory/auth_token``, created with mode 0600 (never
    readable by others, not even for an instant); the environment that makes Ray use it."""
    import secrets
    path = os.path.join(directory, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": path}


class ClusterError(RuntimeError):
    """The cluster did not start; the message carries the init's report and logs."""


# ``argv`` exec'd with SIGINT ignored (see SimulatedCluster.kernel).
IGNORING_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execvp(sys.argv[1], sys.argv[1:])"]


class SimulatedCluster:
    def __init__(self, gpu_nodes: int = 2, cpu_nodes: int = 1, gpus_per_node: int = 2,
                 cpus_per_node: int = 2, object_store_bytes: int = 300_000_000):
        self.address = f"{HEAD_IP}:{PORT}"
        self.client_address = f"ray://{HEAD_IP}:{CLIENT_PORT}"
        self.gpu_node_ips = tuple(f"127.0.1.{i + 1}" for i in range(gpu_nodes))
        self.cpu_node_ips = tuple(f"127.0.2.{i + 1}" for i in range(cpu_nodes))
        self.gpus_per_node = gpus_per_node
        self._cpus = cpus_per_node
        self._store = object_store_bytes
        self.base: str | None = None      # temp dirs and ``ray start`` logs, one per node
        self.pid: int | None = None       # the namespace's init, as seen from outside
        self.failures: list[str] = []   # why earlier start attempts failed, if any
        self._unshare: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()
        self.auth_env: dict[str, str] = {}  # what a process needs to talk to the cluster

    # -- life cycle ---------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT, attempts: int = 2) -> "SimulatedCluster":
        """Start the namespace and every node; return once all are alive in the GCS.

        A failed start is retried in a fresh namespace (``attempts`` in all), its nodes then
        started one after the other: ``ray start`` gives a node a fixed 30 s to register,
        which nodes starting together on an overloaded machine can miss."""
        reason = missing_requirements()
        if reason:
            raise ClusterError(reason)
        self.failures = []
        for attempt in range(attempts):
            try:
                return self._start_once(timeout, sequential=attempt > 0)
            except ClusterError as e:
                self.failures.append(str(e))
                if attempt + 1 == attempts:
                    raise
                warnings.warn(f"simulated cluster: start {attempt + 1} failed, retrying: {e}", stacklevel=2)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float, sequential: bool) -> "SimulatedCluster":
        # Short: Ray's Unix socket paths live under each temp dir (107-byte limit).
        self.base = tempfile.mkdtemp(prefix="taas-cluster-")
        spec_path = os.path.join(self.base, "spec.json")
        with open(spec_path, "w") as f:
            json.dump({**self._spec(), "sequential": sequential}, f)
        self.auth_env = write_auth_token(self.base)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        # TMPDIR: what Ray writes outside --temp-dir (ray_current_cluster) stays in ours.
        env.update(TMPDIR=self.base, RAY_USAGE_STATS_ENABLED="0", **self.auth_env)
        self._lines = queue.Queue()
        self._unshare = subprocess.Popen(
            ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child",
             sys.executable, _INIT, spec_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read_lines, args=(self._unshare, self._lines),
                         daemon=True).start()
        deadline = time.monotonic() + timeout
        try:
            self._expect("lo up", deadline)
            self.pid = self._init_pid()
            self._expect("ready", deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill the namespace's init (the kernel then kills everything inside), wait until
        no process of the namespace is left, remove the temp dirs.  Idempotent."""
        if self._unshare is not None:
            leftovers = self.processes()
            # While unshare is not reaped, neither the init's pid nor unshare's process group
            # (unshare, the init, ``ray start``s) can be reused: safe to signal.
            if self._unshare.poll() is None:
                if self.pid:
                    try:
                        os.kill(self.pid, signal.SIGKILL)
                    except ProcessLookupError:  # it exited (a failed start) and unshare reaped it
                        pass
                else:  # start failed before the init was found: its process group holds it
                    os.killpg(self._unshare.pid, signal.SIGKILL)
            self._unshare.stdin.close()
            self._unshare.wait()
            psutil.wait_procs(leftovers, timeout=60)
            self._unshare = None
            self.pid = None
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def __enter__(self) -> "SimulatedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inside the namespace -----------------------------------------------------------

    def command(self, argv: list[str], cwd: str | None = None, auth: bool = True) -> list[str]:
        """``argv`` prefixed to run inside the namespace, in ``cwd`` (default: this process's;
        entering the mount namespace would otherwise put it in /), with the cluster's
        ``auth_env`` (``env`` execs: the pid and process group stay nsenter's child's), or
        with token authentication explicitly off (``auth=False``: a client without the token)."""
        assert self.pid, "the cluster is not started"
        if auth:
            settings = [f"{k}={v}" for k, v in sorted(self.auth_env.items())]
        else:
            settings = ["-u", "RAY_AUTH_TOKEN_PATH", "-u", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE=disabled"]
        return ["nsenter", "--target", str(self.pid), "--net", "--pid", "--mount",
                f"--wd={os.path.abspath(cwd or os.getcwd())}", "env", *settings, *argv]

    def run(self, argv: list[str], cwd: str | None = None, auth: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside the namespace."""
        return subprocess.run(self.command(argv, cwd, auth), **kw)

    def popen(self, argv: list[str], cwd: str | None = None, **kw) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside the namespace (the Popen's pid is nsenter's,
        outside; the command is its child, inside)."""
        return subprocess.Popen(self.command(argv, cwd), **kw)

    def kernel(self, cwd: str, env: dict | None = None, load_taas: bool = True):
        """A Jupyter kernel inside the namespace, driven from here over IPC (Unix sockets in
        jupyter's runtime dir): a ``tests.support.kernel_driver.Kernel``.  Interrupts reach it: the
        provisioner signals nsenter's process group, which the kernel belongs to.

        nsenter itself must outlive an interrupt: it neither handles nor forwards SIGINT, so the
        group's SIGINT would end it (the kernel inside lives on, but its manager sees it exit).
        It starts with SIGINT ignored (an exec keeps that); the kernel does not mind, as
        ipykernel ignores SIGINT itself and installs Python's handler around each request."""
        from tests.support.kernel_driver import Kernel
        return Kernel(cwd, load_taas=load_taas, env=env, transport="ipc",
                      command_prefix=[*IGNORING_SIGINT, *self.command([], cwd)])

    def processes(self) -> list[psutil.Process]:
        """Every live process in the namespace (outer pids), entered ones included."""
        if not self.pid:
            return []
        try:
            ns = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return []
        found = []
        for p in psutil.process_iter():
            try:
                if os.readlink(f"/proc/{p.pid}/ns/pid") == ns and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (OSError, psutil.Error):  # it ended while we looked: not a survivor
                continue
        return found

    # -- internals ----------------------------------------------------------------------

    def _spec(self) -> dict:
        common = ["--object-store-memory", str(self._store), "--disable-usage-stats"]

        def node(name: str, ip: str, *resources: str) -> dict:
            return {"name": name, "args": [
                "--address", self.address, "--node-ip-address", ip, "--temp-dir",
                os.path.join(self.base, name), "--num-cpus", str(self._cpus), *resources, *common]}

        nodes = [node(f"g{i + 1}", ip, "--num-gpus", str(self.gpus_per_node), "--resources", '{"gpu_node": 1}')
                 for i, ip in enumerate(self.gpu_node_ips)]
        nodes += [node(f"c{i + 1}", ip, "--resources", '{"cpu_node": 1}')
                  for i, ip in enumerate(self.cpu_node_ips)]
        head = ["--head", "--node-ip-address", HEAD_IP, "--port", str(PORT), "--temp-dir",
                os.path.join(self.base, "h"), "--num-cpus", "0", "--num-gpus", "0",
                "--include-dashboard=false", "--ray-client-server-port", str(CLIENT_PORT), *common]
        return {"ray": _ray_executable(), "python": sys.executable, "base": self.base,
                "address": self.address, "head": head, "nodes": nodes}

    @staticmethod
    def _read_lines(unshare: subprocess.Popen, lines: queue.Queue) -> None:
        for raw in unshare.stdout:
            lines.put(raw.decode(errors="replace").rstrip("\n"))
        lines.put(None)

    def _expect(self, prefix: str, deadline: float) -> str:
        """Wait for the init's next progress line starting with ``prefix``; an error line, its
        exit or the deadline raise ClusterError."""
        seen = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ClusterError(f"no {prefix!r} from the cluster's init in time; "
                                   f"saw {seen}") from None
            if line is None or line.startswith("error"):
                raise ClusterError(f"the cluster did not start: {line or 'init exited'}; "
                                   f"saw {seen}")
            seen.append(line)
            if line.startswith(prefix):
                return line

    def _init_pid(self) -> int | None:
        """The init is unshare's only child (it forked it before the init said anything);
        None if it has already exited (a start that failed at once: ``stop()`` then has
        nothing inside to kill)."""
        children = psutil.Process(self._unshare.pid).children()
        assert len(children) <= 1, children
        return children[0].pid if children else None
