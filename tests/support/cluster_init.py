"""PID 1 of a simulated Ray cluster's namespace (started by tests/support/cluster.py; stdlib only).

Usage: ``python cluster_init.py SPEC`` where SPEC is a JSON file written by
``SimulatedCluster.start``:  ``{"ray": path, "python": path, "base": dir, "address": "ip:port",
"head": [args...], "nodes": [{"name": n, "args": [args...]}, ...], "sequential": bool}``.

Why a program of its own as init: PID 1 of a PID namespace inherits every orphan (``ray start``
daemonises its processes and exits), so it must reap them or zombies pile up; and when PID 1
exits the kernel kills everything in the namespace, which makes "stop the cluster" one SIGKILL.

What it does, reporting each step as one line on stdout (the parent waits for these lines,
never for a time):  ``lo up`` -> ``head up`` -> ``nodes up`` -> ``ready N`` (N nodes alive in
the GCS), or ``error: ...`` and exit.  Then it reaps orphans until its stdin reaches EOF — the
parent (the test session) closed it or died — and exits, ending the namespace with it.
"""

import json
import os
import signal
import socket
import subprocess
import sys

# Upper bound for a node count that never comes: only a broken cluster reaches it.
NODES_TIMEOUT = 300.0

# Run by the init's own python in a child process (the init stays small: it never imports ray).
# GcsClient is Ray's internal client of the head's GCS: it lists nodes without connecting a
# driver (a ray.init() would cost seconds and start a driver's worker machinery).
_COUNT_ALIVE = """
import sys, time
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
client = GcsClient(address=sys.argv[1])
want, deadline = int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    alive = [n for n in client.get_all_node_info().values() if n.state == GcsNodeInfo.ALIVE]
    if len(alive) >= want:
        print(len(alive))
        break
    if time.monotonic() > deadline:
        sys.exit(f"{len(alive)} of {want} nodes alive after {sys.argv[3]}s")
    time.sleep(0.2)
"""


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def reap(*_):
    """SIGCHLD: collect every exited child (orphans of the namespace included)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def ray_start(spec: dict, name: str, args: list) -> subprocess.Popen:
    """``ray start`` for one node, its output in ``base/name.log`` (kept for a failure's report)."""
    log = open(os.path.join(spec["base"], f"{name}.log"), "wb")
    return subprocess.Popen([spec["ray"], "start", *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def check(spec: dict, name: str, proc: subprocess.Popen) -> None:
    if proc.wait() != 0:
        fail(spec, f"ray start of node {name} failed:", name)


def fail(spec: dict, what: str, name: str | None = None) -> None:
    tail = ""
    if name:
        try:
            with open(os.path.join(spec["base"], f"{name}.log"), errors="replace") as f:
                tail = " | ".join(f.read().splitlines()[-15:])
        except OSError:
            pass
    say(f"error: {what} {tail}".rstrip())
    sys.exit(1)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if subprocess.run(["ip", "link", "set", "lo", "up"]).returncode != 0:
        fail(spec, "ip link set lo up failed")
    say("lo up")
    # This machine's name resolves to loopback inside (Ray falls back to resolving it when it
    # finds no route out, and a driver must find its local raylet at 127.0.0.1, whatever the
    # host's /etc/hosts says).  A bind mount in the namespace's private mount table only.
    hosts = os.path.join(spec["base"], "hosts")
    with open(hosts, "w") as f:
        f.write(f"127.0.0.1 localhost {socket.gethostname()}\n::1 localhost\n")
    if subprocess.run(["mount", "--bind", hosts, "/etc/hosts"]).returncode != 0:
        fail(spec, "mount --bind of /etc/hosts failed")

    # The head first: the nodes register with its GCS.
    head = ray_start(spec, "head", spec["head"])
    if head.wait() != 0:
        fail(spec, "ray start --head failed:", "head")
    say("head up")

    # The other nodes join in parallel (fast), or one after the other (each node then has the
    # CPU to itself: ``ray start`` gives its node a fixed 30 s to register, which a node
    # competing with the others on a loaded machine can miss).
    nodes = []
    for node in spec["nodes"]:
        nodes.append((node["name"], ray_start(spec, node["name"], node["args"])))
        if spec["sequential"]:
            check(spec, *nodes[-1])
    for name, proc in nodes:
        check(spec, name, proc)
    say("nodes up")

    want = 1 + len(nodes)
    count = subprocess.run([spec["python"], "-c", _COUNT_ALIVE, spec["address"], str(want),
                            str(NODES_TIMEOUT)], capture_output=True, text=True)
    if count.returncode != 0:
        fail(spec, f"nodes not alive: {count.stderr.strip()[-2000:]}")
    say(f"ready {count.stdout.strip()}")

    # From here on: reap orphans as they exit; end when the parent lets go of our stdin.
    signal.signal(signal.SIGCHLD, reap)
    reap()
    while sys.stdin.buffer.read(65536):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
