"""Launch overhead: the same 4-rank job started by torchrun and by taas, side by side.

The job: init the default process group (gloo on CPU, NCCL with --device cuda), one
all_reduce, then a small DDP training loop whose per-step time rank 0 reports.

    python benchmarks/launch.py [--ranks 4] [--repeat 3] [--steps 50]

Printed: median wall time of each way to start the job, and the ratios the project tracks
(taas cold / torchrun, taas warm / torchrun, per-step time taas / torchrun).  Then, in one
session, warm jobs side by side: plain, and reading a --big-mib notebook tensor (the time it
adds, and the job's peak memory with and without it; see _MemorySampler for how).  "cold" is a new
session whose start process is launched at the moment the cell runs (the worst case: in a
notebook ``%load_ext taas`` starts it in the background beforehand); "warm" is the next cell,
run THINK_TIME seconds later (untimed), as a person would: the start process uses that pause to
fork the next job's processes ahead.

Then results back, in one session: warm jobs side by side whose rank 0 binds a --result-mib
tensor, or a model of that size, against the plain warm job and against the same job that makes
the value but does not bind it (what bringing it back adds), the first time and after, with the
notebook's RSS growth once it touched the value (run_results).

Last, a trivial 4-rank cell (an all_reduce and a print per rank) through real Jupyter kernels,
side by side: ``%%taas --gpus 4`` (fresh ranks every cell) against nbdistributed's cell on its
persistent workers, timed from execute_request to the reply; see run_kernels.  And the same
cell on kept ranks (``--keep``), a kept cell reading an unchanged notebook tensor, and many kept
cells' resources: benchmarks/keep.py.
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
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

THINK_TIME = 1.0

BODY = textwrap.dedent(
    """
    import json, os, time
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend=BACKEND, init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for step in range(STEPS + 5):
        if step == 5:  # warm-up steps excluded
            started = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    step_ms = (time.perf_counter() - started) / STEPS * 1000
    if dist.get_rank() == 0:
        print("STEP_MS", json.dumps(step_ms), flush=True)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body(backend: str, steps: int) -> str:
    return f"BACKEND = {backend!r}\nSTEPS = {steps}\n" + BODY


def run_torchrun(script: str, ranks: int, tries: int = 3) -> tuple[float, float]:
    """One torchrun job, timed.  The free port is picked before torchrun binds it (torchrun's
    own way), so another process may take it meanwhile: such a run is retried."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    for attempt in range(tries):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
             "--master_addr=127.0.0.1", f"--master_port={free_port()}", script],
            env=env, capture_output=True, text=True,
        )
        wall = time.perf_counter() - started
        if done.returncode == 0:
            return wall, _step_ms(done.stdout)
        print(f"  (torchrun failed, try {attempt + 1} of {tries}: {done.stderr.strip().splitlines()[-1:]})",
              file=sys.stderr)
    raise RuntimeError(f"torchrun failed {tries} times:\n{done.stderr[-2000:]}")


class _Collect:
    def __init__(self):
        self.text = ""

    def write(self, stream, text):
        self.text += text

    def progress(self, *args, **kwargs):
        pass


def run_taas(session, source: str, ranks: int, device: str, namespace: dict | None = None) -> tuple[float, float]:
    from taas.directive import parse_options

    sink = _Collect()
    started = time.perf_counter()
    session.run_cell(source, dict(namespace or {}), parse_options(f"--gpus {ranks} --device {device} --no-results"),
                     sink=sink)
    wall = time.perf_counter() - started
    return wall, _step_ms(sink.text)


# -- a big notebook value read by the job ------------------------------------------------------
# The cell reads a sample of the notebook's tensor (the time goal: what shipping it costs), or
# sums all of it on every rank (the memory goal: every rank touches every page).
BIG_SAMPLE = "checksum = float(big[:: 1 << 16].sum())\n"
BIG_ALL = "checksum = float(big.sum())\n"


class _MemorySampler:
    """Peak memory of the job, sampled every 20 ms in a thread: the sum over this process (the
    'kernel') and all its descendants (start process, ranks, children forked ahead) of
    Pss_Anon from /proc/PID/smaps_rollup -- private and copy-on-write pages, shared ones split
    between their sharers -- plus what /dev/shm holds beyond ``shm_base`` (the value files and a
    resident tensor's file, counted once however many processes map them)."""

    def __init__(self, shm_base: int):
        import psutil

        self._me = psutil.Process()
        self._shm_base = shm_base
        self.peak = 0
        self._stop = False

    def sample(self) -> int:
        total = 0
        for proc in [self._me] + self._me.children(recursive=True):
            try:
                with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss_Anon:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total + shm_used() - self._shm_base

    def __enter__(self):
        import threading

        def loop():
            while not self._stop:
                self.peak = max(self.peak, self.sample())
                time.sleep(0.02)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run_big(source: str, ranks: int, device: str, repeat: int, mib: int) -> None:
    """Warm jobs side by side in one session: plain, and reading a ``mib`` MiB notebook tensor --
    the first job that references it (it moves to shared memory then) and the jobs after.
    ``session.after_cell()`` runs where the kernel would run it, after each cell."""
    import torch

    from taas.session import Session

    shm_base = shm_used()
    session = Session()
    plain, first, sample, whole, fresh = [], [], [], [], []

    def tensor():
        return {"big": torch.randn(mib << 18)}  # float32: mib MiB

    def fill():  # the floor: touching as much new memory in this process, nothing shared
        started = time.perf_counter()
        torch.ones(mib << 18)
        return started

    try:
        run_taas(session, source, ranks, device)  # cold: untimed
        big = tensor()
        run_taas(session, BIG_SAMPLE + source, ranks, device, big)  # big is resident from here
        # Each row THINK_TIME after the one before.  'fresh' follows an untimed plain job, as
        # 'first' does: memory freed seconds ago can be slower to touch again than memory
        # freed just now (a VM may have handed it back to its host).
        rows = ((plain, source, None), (sample, BIG_SAMPLE + source, big), (whole, BIG_ALL + source, big),
                (None, source, None), (fresh, fill, None), (None, source, None), (first, BIG_SAMPLE + source, tensor))
        for _ in range(repeat):
            for out, cell, namespace in rows:
                if callable(namespace):
                    namespace = namespace()  # a new tensor, made before the pause
                time.sleep(THINK_TIME)
                if callable(cell):
                    started = cell()
                    out.append(time.perf_counter() - started)
                    continue
                wall = run_taas(session, cell, ranks, device, namespace)[0]
                if out is not None:
                    out.append(wall)
                del namespace
                session.after_cell()  # what the kernel runs after every cell (taas frees what it held)
        peaks = []
        for cell, namespace in ((source, None), (BIG_ALL + source, big)):
            time.sleep(THINK_TIME)
            with _MemorySampler(shm_base) as sampler:
                run_taas(session, cell, ranks, device, namespace)
            peaks.append(sampler.peak)
    finally:
        session.close()
    med = statistics.median
    gib = 1 << 30
    print(f"  big    warm {med(plain):7.3f} s | + {mib} MiB tensor: first job {med(first):7.3f} s, "
          f"later jobs {med(sample):7.3f} s | summed by every rank {med(whole):7.3f} s")
    print(f"  added  by the {mib} MiB tensor, first job that reads it = {med(first) - med(plain):+.3f} s   "
          f"(goal <= 0.5; it moves to shared memory in place; for scale: filling {mib} MiB of new "
          f"memory here, same pauses, takes {med(fresh):.3f} s)")
    print(f"  added  by the {mib} MiB tensor, later jobs = {med(sample) - med(plain):+.3f} s   (goal <= 0.5)")
    print(f"  memory peak, every rank summing it: {peaks[1] / gib:.2f} GiB vs {peaks[0] / gib:.2f} GiB plain "
          f"(this process with the tensor, start process, ranks; Pss_Anon + /dev/shm growth)")
    print(f"  memory extra for the job = {(peaks[1] - peaks[0]) / gib:.2f} GiB   (goal <= 1)")


# -- big results back -------------------------------------------------------------------------
# Rank 0 makes a value of the given size (a tensor; a model of 16 Linear layers built on meta and
# filled, so no random init dominates), and binds it or not.  Only rank 0 makes it: the other
# ranks' new memory would only add noise on a small machine.
RESULT_TENSOR = "big = torch.full(({n},), 0.5) if dist.get_rank() == 0 else None\n"
RESULT_MODEL = textwrap.dedent("""
    with torch.device("meta"):
        net = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range(16)])
    if dist.get_rank() == 0:
        net = net.to_empty(device="cpu")
        for p in net.parameters():
            p.data.fill_(0.01)
""")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_results(source: str, ranks: int, device: str, repeat: int, mib: int) -> None:
    """Warm jobs side by side in one session, results on: plain; a ``mib`` MiB tensor made and
    bound on rank 0 (brought back), or made and deleted (not brought back); the same for a model
    of about that size.  Each bound value is touched (summed) in this process, after the timed
    cell, to measure the RSS it added."""
    import torch

    from taas.directive import parse_options
    from taas.session import Session

    width = int((mib * (1 << 20) / 4 / 16) ** 0.5)  # 16 square layers of float32: ~mib MiB
    tensor = RESULT_TENSOR.format(n=mib << 18)
    model = RESULT_MODEL.format(width=width)
    rows = {"plain": source, "tensor made": source + tensor + "del big\n", "tensor bound": source + tensor,
            "model made": source + model + "del net\n", "model bound": source + model}
    times: dict[str, list[float]] = {k: [] for k in rows}
    growth: dict[str, list[float]] = {"tensor bound": [], "model bound": []}
    options = parse_options(f"--gpus {ranks} --device {device}")
    session = Session()
    try:
        session.run_cell(source, {}, options, sink=_Collect())  # cold: untimed
        for _ in range(repeat):
            for name, cell in rows.items():
                time.sleep(THINK_TIME)
                namespace: dict = {}
                rss = _rss()
                started = time.perf_counter()
                got = session.run_cell(cell, namespace, options, sink=_Collect())
                times[name].append(time.perf_counter() - started)
                if name in growth:
                    value = got.values["big" if name.startswith("tensor") else "net"]
                    parts = [value] if isinstance(value, torch.Tensor) else list(value.parameters())
                    assert all(float(p.detach().sum()) > 0 for p in parts)  # every page touched
                    growth[name].append((_rss() - rss) / (1 << 30))
                    del value, parts
                del got, namespace
                session.after_cell()
    finally:
        session.close()
    med = statistics.median
    plain = med(times["plain"])
    print(f"  results  warm plain {plain:7.3f} s | rank 0 binds a {mib} MiB tensor / a "
          f"{16 * width * (width + 1) * 4 / (1 << 30):.2f} GiB model (16 x Linear({width}, {width}))")
    for kind in ("tensor", "model"):
        bound, made = times[f"{kind} bound"], times[f"{kind} made"]
        later = bound[1:] or bound
        print(f"  results  {kind}: made, not bound {med(made):7.3f} s | bound: first time {bound[0]:7.3f} s, "
              f"after {med(later):7.3f} s")
        print(f"  added    by bringing the {kind} back (bound - made): first {bound[0] - med(made):+.3f} s, "
              f"after {med(later) - med(made):+.3f} s   (goal <= 0.5 per GiB) | vs plain: first "
              f"{bound[0] - plain:+.3f} s, after {med(later) - plain:+.3f} s")
        print(f"  memory   notebook RSS growth with the {kind} touched: {med(growth[f'{kind} bound']):.2f} GiB "
              f"(the value: {mib / 1024:.2f} GiB; goal: no more than the value)")


def _step_ms(text: str) -> float:
    for line in text.splitlines():
        if "STEP_MS" in line:
            return json.loads(line.split("STEP_MS", 1)[1])
    raise RuntimeError(f"no STEP_MS in output:\n{text}")


# -- a trivial cell through real kernels: taas vs nbdistributed ------------------------------
# The same body in both: every rank all-reduces a one and prints the sum.
TRIVIAL = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} sum {t.item():g}")
    """
).strip()

NBD_VERSION = "0.1.0"  # the patches in NBD_SETUP are written against this release's code

# Run in the nbdistributed kernel before its %dist_init.  nbdistributed 0.1.0, as shipped, would
# listen on every interface and its %dist_shutdown / %dist_reset end processes by name
# (pkill -f).  So, inside that kernel only:
# - its ZMQ coordinator socket binds 127.0.0.1 (upstream: tcp://*), and its free-port probe
#   binds 127.0.0.1 (upstream: every interface);
# - the workers' rendezvous store is hosted by this benchmark on 127.0.0.1 (port STORE_PORT),
#   and TORCHELASTIC_USE_AGENT_STORE makes every worker a client of it (upstream: rank 0's
#   TCPStore listens on every interface); gloo uses lo (GLOO_SOCKET_IFNAME);
# - its shutdown paths that kill by name raise instead; its workers are ended by this benchmark,
#   by pid and by the kernel's process group (see NbdKernel.close).
# NbdKernel checks, after %dist_init, that every listening socket of the kernel and its
# workers is on loopback, and gives up otherwise.
NBD_SETUP = textwrap.dedent(
    """
    import socket as _socket, threading as _threading
    import zmq as _zmq
    import nbdistributed.magic as _nbd_magic
    from importlib.metadata import version as _version
    from nbdistributed.communication import CommunicationManager as _Comm
    from nbdistributed.process_manager import ProcessManager as _PM

    assert _version("nbdistributed") == NBD_VERSION, _version("nbdistributed")

    def _loopback_port():
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    class _LoopbackComm(_Comm):
        def __init__(self, num_processes, base_port=5555, output_callback=None):
            # CommunicationManager.__init__ of 0.1.0 but for the bind address
            self.num_processes, self.base_port = num_processes, base_port
            self.output_callback = output_callback
            self.context = _zmq.Context()
            self.coordinator_socket = self.context.socket(_zmq.ROUTER)
            self.coordinator_socket.bind(f"tcp://127.0.0.1:{base_port}")
            self.worker_sockets, self.message_queue, self.response_events = {}, {}, {}
            self.running = True
            self.handler_thread = _threading.Thread(target=self._message_handler, daemon=True)
            self.handler_thread.start()

    _start_workers = _PM.start_workers

    def _start_on_loopback(self, num_processes, master_addr="127.0.0.1", gpu_ids=None):
        # start_workers asks for the master port (the store's: popped first), then the ZMQ port
        ports = [_loopback_port(), STORE_PORT]
        self._find_free_port = ports.pop
        return _start_workers(self, num_processes, master_addr, gpu_ids)

    def _refuse(*args, **kwargs):
        raise RuntimeError("disabled by the benchmark: it kills processes by name (pkill -f)")

    _PM.start_workers = _start_on_loopback
    _nbd_magic.CommunicationManager = _LoopbackComm
    _nbd_magic.DistributedMagic._nuclear_shutdown = classmethod(_refuse)
    _nbd_magic.DistributedMagic.force_shutdown_all = classmethod(_refuse)
    """
)


class NbdKernel:
    """A Jupyter kernel with nbdistributed's ``ranks`` persistent workers, on loopback only."""

    def __init__(self, cwd: str, ranks: int):
        import torch.distributed as dist

        from tests.support.kernel_driver import OFFLINE, Kernel, wait_for

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        # The workers' rendezvous store (see NBD_SETUP), owned by this process from here on.
        self.store = dist.TCPStore("127.0.0.1", port, ranks, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listener.detach())
        env = dict(OFFLINE, GLOO_SOCKET_IFNAME="lo", TORCHELASTIC_USE_AGENT_STORE="True",
                   # its workers are started as "python": this interpreter
                   PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
        self.kernel = Kernel(cwd, load_taas=False, env=env)
        self.workers = []
        try:
            setup = NBD_SETUP.replace("NBD_VERSION", repr(NBD_VERSION))
            setup = setup.replace("STORE_PORT", str(port))
            for code in (setup, "%load_ext nbdistributed", f"%dist_init -n {ranks} -a 127.0.0.1"):
                run = self.kernel.run(code)
                if run.error is not None:
                    raise RuntimeError(f"nbdistributed set-up failed:\n{run.traceback}")
            if "Successfully started" not in run.stdout:
                raise RuntimeError(f"nbdistributed did not start:\n{run.stdout}{run.stderr}")
            self.workers = self.kernel.descendants()
            wait_for(self._connected, what="nbdistributed's workers connecting to its kernel")
            self._check_loopback()
        except BaseException:  # Ctrl-C included: never leave its workers behind; re-raised
            self.close()
            raise

    def _connected(self) -> bool:
        """Every worker is connected to a port the kernel listens on (its ZMQ coordinator
        socket: the workers connect to it once their process group is up).  Until then a cell
        is lost: nbdistributed's ROUTER drops messages to workers it has not seen, and its
        %dist_init only sleeps 2 s, less than 4 workers importing torch take on a busy machine."""
        import psutil

        kernel_ports = {c.laddr.port for c in psutil.Process(self.kernel.pid).net_connections(kind="tcp")
                        if c.status == psutil.CONN_LISTEN}
        for proc in self.workers:
            try:
                conns = proc.net_connections(kind="tcp")
            except psutil.Error:
                raise RuntimeError(f"an nbdistributed worker ({proc.pid}) ended during start-up") from None
            if not any(c.raddr and c.raddr.port in kernel_ports and c.status == psutil.CONN_ESTABLISHED
                       for c in conns):
                return False
        return True

    def _check_loopback(self) -> None:
        import psutil

        pids = {self.kernel.pid} | {p.pid for p in self.workers}
        wild = [f"{c.pid}:{c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections(kind="inet")
                if c.pid in pids and c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")]
        if wild:
            raise RuntimeError(f"nbdistributed listens beyond loopback: {wild}")

    def run(self, code: str):
        return self.kernel.run(code)

    def close(self) -> None:
        """End the kernel and its workers: by process group (the kernel leads its own session,
        its workers are in it) and by pid; never by name."""
        import psutil

        workers = self.workers or self.kernel.descendants()
        try:
            os.killpg(self.kernel.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in workers:
            try:
                proc.kill()  # psutil checks that the pid is still that process
            except psutil.Error:
                pass
        psutil.wait_procs(workers, timeout=5)
        self.kernel.shutdown()
        self.store = None


def _timed(kernel, code: str, expect: str) -> float:
    started = time.perf_counter()
    run = kernel.run(code)
    wall = time.perf_counter() - started
    if run.error is not None or run.status != "ok" or expect not in run.stdout:
        raise RuntimeError(f"the trivial cell failed:\n{run.stdout}{run.stderr}{run.traceback}")
    return wall


def run_kernels(ranks: int, repeat: int) -> None:
    """The trivial cell through real kernels, rounds interleaved: taas's warm cell (fresh
    ranks each time) and nbdistributed's cell on its persistent workers, each THINK_TIME after
    the one before, after one untimed warm-up cell each."""
    from tests.support.kernel_driver import OFFLINE, Kernel

    try:
        from importlib.metadata import version

        if version("nbdistributed") != NBD_VERSION:
            print(f"  kernel case skipped: it needs nbdistributed {NBD_VERSION} (pip install .[bench])")
            return
    except ImportError:  # PackageNotFoundError: not installed
        print(f"  kernel case skipped: it needs nbdistributed {NBD_VERSION} (pip install .[bench])")
        return
    taas_cell = f"%%taas --gpus {ranks}\n{TRIVIAL}"
    expect = f"rank {ranks - 1} sum {ranks}"
    taas_times, nbd_times = [], []
    with tempfile.TemporaryDirectory() as cwd:
        taas_kernel = Kernel(cwd, env=OFFLINE)
        nbd = None
        try:
            nbd = NbdKernel(cwd, ranks)
            _timed(taas_kernel, taas_cell, expect)  # warm-up: the start process is up
            _timed(nbd, TRIVIAL, expect)
            for _ in range(repeat):
                for times, kernel, code in ((taas_times, taas_kernel, taas_cell), (nbd_times, nbd, TRIVIAL)):
                    time.sleep(THINK_TIME)
                    times.append(_timed(kernel, code, expect))
        finally:
            taas_kernel.shutdown()
            if nbd is not None:
                nbd.close()
    med = statistics.median
    print(f"  kernel trivial {ranks}-rank cell, median of {repeat}: taas warm {med(taas_times):.3f} s "
          f"(fresh ranks) | nbdistributed {med(nbd_times):.3f} s (persistent workers)")
    print(f"  ratio  kernel taas/nbdistributed = {med(taas_times) / med(nbd_times):.3f}   (goal <= 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--big-mib", type=int, default=1024,
                        help="size of the notebook tensor of the big-value case (0: skip it)")
    parser.add_argument("--result-mib", type=int, default=1024,
                        help="size of the value rank 0 binds in the results-back case (0: skip it)")
    parser.add_argument("--only-results", action="store_true", help="run only the results-back case")
    parser.add_argument("--kernel-repeat", type=int, default=10,
                        help="rounds of the trivial cell through real kernels, taas vs nbdistributed (0: skip)")
    parser.add_argument("--only-kernel", action="store_true", help="run only the real-kernel case")
    parser.add_argument("--keep-cells", type=int, default=200,
                        help="kept cells in the --keep case's resources run (benchmarks/keep.py; -1: skip the case)")
    args = parser.parse_args()
    if args.only_kernel:
        run_kernels(args.ranks, args.kernel_repeat)
        return
    backend = "nccl" if args.device == "cuda" else "gloo"
    source = body(backend, args.steps)
    if args.only_results:
        run_results(source, args.ranks, args.device, args.repeat, args.result_mib)
        return

    from taas.session import Session

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(source)
        torchrun, cold, warm = [], [], []
        for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits all alike
            torchrun.append(run_torchrun(script, args.ranks))
            session = Session()
            try:
                cold.append(run_taas(session, source, args.ranks, args.device))
                time.sleep(THINK_TIME)  # untimed: a person reads the output, then runs the next cell
                warm.append(run_taas(session, source, args.ranks, args.device))
            finally:
                session.close()

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    print(f"{args.ranks} ranks, {backend}, {args.steps} DDP steps, median of {args.repeat} runs")
    print(f"  wall   torchrun {med(torchrun, 0):7.3f} s | taas cold {med(cold, 0):7.3f} s "
          f"| taas warm {med(warm, 0):7.3f} s")
    print(f"  step   torchrun {med(torchrun, 1):7.3f} ms | taas cold {med(cold, 1):7.3f} ms "
          f"| taas warm {med(warm, 1):7.3f} ms")
    print(f"  ratio  cold/torchrun = {med(cold, 0) / med(torchrun, 0):.3f}   (goal <= 0.5)")
    print(f"  ratio  warm/torchrun = {med(warm, 0) / med(torchrun, 0):.3f}   (goal <= 0.05)")
    step_ratio = statistics.median([w[1] for w in warm]) / med(torchrun, 1)
    print(f"  ratio  step taas/torchrun = {step_ratio:.3f}   (goal <= 1.03)")
    if args.big_mib:
        run_big(source, args.ranks, args.device, args.repeat, args.big_mib)
    if args.result_mib:
        run_results(source, args.ranks, args.device, args.repeat, args.result_mib)
    if args.kernel_repeat:
        run_kernels(args.ranks, args.kernel_repeat)
    if args.keep_cells >= 0:  # kept ranks (--keep), side by side in the same run
        from benchmarks.keep import run_all

        run_all(args.ranks, args.kernel_repeat or args.repeat, args.big_mib, args.keep_cells)


if __name__ == "__main__":
    main()
