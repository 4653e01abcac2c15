"""Loader -> rank across nodes: the TCP transport against a bare TCP socket and Ray's object store.

    python benchmarks/cluster_data.py [--batches 200] [--rounds 3] [--no-ray]

The same 4 MiB float32 batches (a pool of 16 distinct ones, cycled) move from a producer process
to a consumer, three ways, in one run:

1. taas: a loader-worker process sends them through :mod:`taas.data.tcp.transport` (its stream
   to a relay process, which puts them into the rank's shared-memory ring); this process reads
   them as a rank does (the receiver of the rank's view).
2. bare TCP: a process writes the same bytes to a plain socket on the same loopback; this
   process reads each batch into a reused buffer (the ceiling for one stream).
3. Ray: a producer actor on one Ray node returns each batch, a consumer actor on another node
   gets it (the object moves between the two nodes' object stores), 8 batches in flight.  Ray
   runs in a private network and pid namespace (``unshare``, as root) with a two-node local
   cluster (:mod:`ray.cluster_utils`), and is ended by killing the namespace's init.

GB/s are counted where the batches arrive, from the first to the last.  Goals (issue 9):
taas >= 2x Ray, >= 0.5x bare TCP.  On one machine the "nodes" share memory bandwidth and
cores: the figures compare the three paths, they are not a network measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 1 << 20
BATCH = 4 * MiB
POOL = 16


def pool():
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.standard_normal(BATCH // 4, dtype=np.float32) for _ in range(POOL)]


def rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) * BATCH / (stamps[-1] - stamps[0]) / 1e9


# -- 1. taas ---------------------------------------------------------------------------------
def run_taas(batches: int) -> float:
    import torch

    from taas.data.tcp.transport import TcpTransport
    from taas.data.transport import BLOCKED, DONE, LOADING, attach, resolve

    job_id = "bench" + uuid.uuid4().hex[:8]
    transport = TcpTransport(job_id)
    pids = []
    try:
        address = transport.channels(0, 1, [(0, 0)], 64 * MiB)
        (relay,) = transport.processes({})
        pids.append(_fork(lambda: resolve(relay.entry)(relay)))

        def produce() -> int:
            torch.set_num_threads(1)
            data = [torch.from_numpy(a) for a in pool()]
            endpoint = attach(address)
            control = endpoint.worker(0)
            tx = endpoint.sender(0, lambda waiting: control.set_state(BLOCKED if waiting else LOADING))
            control.prefetched()
            for u in range(batches):
                if not tx.put(u, data[u % POOL]):
                    return 3
                control.produced(u + 1)
            tx.end_pass(0, batches)
            control.set_state(DONE)
            return 0

        pids.append(_fork(produce))
        rx = attach(address).receiver(0)
        stamps = []
        for _ in range(batches):
            value, _ = rx.take()
            stamps.append(time.perf_counter())
            assert value.numel() * 4 == BATCH
            del value
        rx.skip()
        rx.close()
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        pids = []
        return rate(stamps)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        transport.close()


# -- 2. bare TCP -----------------------------------------------------------------------------
def run_bare(batches: int) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def produce() -> int:
        data = pool()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for u in range(batches):
                sock.sendall(memoryview(data[u % POOL]).cast("B"))
        return 0

    pid = _fork(produce)
    conn, _ = listener.accept()
    listener.close()
    buf = memoryview(bytearray(BATCH))
    stamps = []
    for _ in range(batches):
        view = buf
        while view.nbytes:
            view = view[conn.recv_into(view):]
        stamps.append(time.perf_counter())
    conn.close()
    os.waitpid(pid, 0)
    return rate(stamps)


# -- 3. Ray, inside a private namespace ------------------------------------------------------
def ray_inside(batches: int, rounds: int) -> None:
    """Runs as the namespace's payload: a two-node Ray cluster on this namespace's loopback."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"gpu_node": 1}, object_store_memory=512 * MiB))
    cluster.add_node(num_cpus=1, resources={"loader_node": 1}, object_store_memory=512 * MiB)
    ray.init(address=cluster.address)

    @ray.remote(num_cpus=0, resources={"loader_node": 1})
    class Producer:
        def __init__(self):
            self.data = pool()

        def batch(self, u: int):
            return self.data[u % POOL]

    @ray.remote(num_cpus=0, resources={"gpu_node": 1})
    class Consumer:
        def run(self, producer, n: int, window: int = 8) -> float:
            refs = [producer.batch.remote(u) for u in range(min(window, n))]
            stamps = []
            for u in range(n):
                value = ray.get(refs[u])
                stamps.append(time.perf_counter())
                assert value.nbytes == BATCH
                del value
                refs[u] = None
                if u + window < n:
                    refs.append(producer.batch.remote(u + window))
            return rate(stamps)

    producer, consumer = Producer.remote(), Consumer.remote()
    figures = [ray.get(consumer.run.remote(producer, batches)) for _ in range(rounds)]
    print(json.dumps({"ray": figures}), flush=True)
    ray.shutdown()
    cluster.shutdown()


def run_ray(batches: int, rounds: int) -> list[float]:
    if os.geteuid() != 0:
        raise SystemExit("the Ray comparison needs root (a private network namespace); use --no-ray")
    import tempfile

    from tests.support.cluster import write_auth_token

    token_dir = tempfile.mkdtemp(prefix="taas-bench-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray's token authentication with a private token (never the user's ~/.ray/auth_token).
    env.update(write_auth_token(token_dir), PYTHONPATH=os.pathsep.join([ROOT] + sys.path[1:]))
    cmd = ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--kill-child",
           sys.executable, os.path.abspath(__file__), "--ray-inside", "--batches", str(batches),
           "--rounds", str(rounds)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            _kill_namespace(proc.pid)
            proc.wait()
        import shutil
        shutil.rmtree(token_dir, ignore_errors=True)
    for line in out.splitlines():
        if line.startswith('{"ray"'):
            return json.loads(line)["ray"]
    raise RuntimeError(f"the Ray run gave no figures:\n{err[-3000:]}")


def _kill_namespace(unshare_pid: int) -> None:
    """Kill the namespace's init (unshare's child): every process of the namespace dies with it."""
    try:
        with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return pid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--ray-inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ray_inside:
        ray_inside(args.batches, args.rounds)
        return
    taas, bare = [], []
    for _ in range(args.rounds):  # interleaved: both see the same machine load
        taas.append(run_taas(args.batches))
        bare.append(run_bare(args.batches))
    ray = [] if args.no_ray else run_ray(args.batches, args.rounds)
    med = statistics.median
    print(f"loader -> rank, {args.batches} batches of 4 MiB, median of {args.rounds} rounds (GB/s):")
    print(f"  taas TCP transport   {med(taas):6.2f}   rounds: {', '.join(f'{x:.2f}' for x in taas)}")
    print(f"  bare TCP socket      {med(bare):6.2f}   rounds: {', '.join(f'{x:.2f}' for x in bare)}")
    if ray:
        print(f"  Ray object store     {med(ray):6.2f}   rounds: {', '.join(f'{x:.2f}' for x in ray)}")
    print(f"  taas / bare TCP      {med(taas) / med(bare):6.2f}x  (goal >= 0.5x)")
    if ray:
        print(f"  taas / Ray           {med(taas) / med(ray):6.2f}x  (goal >= 2x)")


if __name__ == "__main__":
    main()
