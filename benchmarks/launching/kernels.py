"""A trivial cell through real Jupyter kernels: taas against nbdistributed's persistent workers."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import sys
import tempfile
import textwrap
import time

from benchmarks.launching.job import THINK_TIME

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


def timed(kernel, code: str, expect: str) -> float:
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
            timed(taas_kernel, taas_cell, expect)  # warm-up: the start process is up
            timed(nbd, TRIVIAL, expect)
            for _ in range(repeat):
                for times, kernel, code in ((taas_times, taas_kernel, taas_cell), (nbd_times, nbd, TRIVIAL)):
                    time.sleep(THINK_TIME)
                    times.append(timed(kernel, code, expect))
        finally:
            taas_kernel.shutdown()
            if nbd is not None:
                nbd.close()
    med = statistics.median
    print(f"  kernel trivial {ranks}-rank cell, median of {repeat}: taas warm {med(taas_times):.3f} s "
          f"(fresh ranks) | nbdistributed {med(nbd_times):.3f} s (persistent workers)")
    print(f"  ratio  kernel taas/nbdistributed = {med(taas_times) / med(nbd_times):.3f}   (goal <= 1)")

