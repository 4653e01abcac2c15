"""One kernel's taas: runs a cell as a job, from options to results.  No IPython here.

    options ──resolve──> world/device/backend
    cell ──analyse──> free names ──select+ship──> payload.pkl       (fails before launch)
    launcher.start(LaunchSpec) ──events──> OutputRouter ──> Sink      (live output)
                               ──exits───> done / first failure -> stop all
    result.pkl (rank 0) ──> names and Out[] for the notebook

The magics layer (:mod:`taas.magics`) is a thin adapter over :meth:`Session.run_cell`; tests
and scripts call it directly with a plain dict as the namespace.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

from taas import directive
from taas.errors import CellSyntaxError, JobFailed, LaunchError
from taas.io import failure, hang
from taas.io.output import LineSplitter, OutputRouter, Sink, TerminalSink
from taas.job import analysis, crossing, merge, package
from taas.job.bigvalues import BigValues
from taas.launch.api import LaunchSpec, ProcessExit, ProcessSpec
from taas.launch.local import LocalLauncher
from taas.shield import import_shielded
from taas.worker import comm, report, stacks

STOP_GRACE = 1.0  # seconds between SIGTERM and SIGKILL when a job is stopped
STACK_WAIT = 2.0  # seconds to wait for the ranks' stacks (taas.worker.stacks) before going on


@dataclass
class CellResult:
    values: dict = field(default_factory=dict)  # names rank 0 bound, for the notebook
    out: object = None
    has_out: bool = False
    notes: list[str] = field(default_factory=list)  # one-line notes to show


@dataclass
class JobStats:
    job_id: str
    world_size: int
    device: str
    backend: str
    wall_s: float = 0.0
    outcome: str = "running"
    exit_codes: dict = field(default_factory=dict)
    loaders: list[str] = field(default_factory=list)
    config: str | None = None  # DataSphere '#!NAME' configuration line, if the cell had one
    data: list[str] = field(default_factory=list)  # the data plane's summary lines
    comm_ops: dict = field(default_factory=dict)  # rank key -> operations on its groups (comm)


def cuda_device_count() -> int:
    # An interrupt must not cut the kernel's first `import torch` in half (see taas.shield).
    import_shielded("torch", "torch.distributed")
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _loopback_ifname() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else None


class Session:
    def __init__(self, launcher=None):
        self.launcher = launcher or LocalLauncher()
        self.last: JobStats | None = None
        # One job at a time per kernel (a cell may run one from a thread): the launcher's
        # channel to the start process is not shared.
        self._running = threading.Lock()
        self._running_since: str | None = None
        self._stacks: dict[str, dict] = {}  # rank key -> its latest "stack" event

    def warm(self) -> None:
        if hasattr(self.launcher, "warm"):
            self.launcher.warm()

    def close(self) -> None:
        self.launcher.shutdown()

    # ------------------------------------------------------------------------------------
    def run_cell(self, source: str, namespace: dict, options: directive.JobOptions, **kwargs) -> CellResult:
        """Run ``source`` as a job (see :meth:`_run_cell`); a second job while one runs in this
        kernel is refused at once."""
        if not self._running.acquire(blocking=False):
            raise LaunchError(
                f"a taas job is already running in this kernel (started at {self._running_since}); "
                "wait for it to finish or interrupt it, then run this cell again")
        try:
            self._running_since = time.strftime("%H:%M:%S")
            return self._run_cell(source, namespace, options, **kwargs)
        finally:
            self._running.release()

    def _run_cell(self, source: str, namespace: dict, options: directive.JobOptions, *,
                  filename: str = "<taas cell>", first_line: int = 1, sink: Sink | None = None,
                  hidden: frozenset = frozenset(), name_for=None) -> CellResult:
        sink = sink or TerminalSink()
        cwd = working_directory()  # before anything else: even importing torch needs it
        cuda_devices = cuda_device_count()
        world, device, backend, note = directive.resolve_world(options, cuda_devices)
        try:
            analysis.compile_cell(source, filename, first_line)
        except SyntaxError as exc:
            raise _syntax_error(exc, name_for) from None
        cell = analysis.analyse(source)
        values = package.select(cell.free, namespace, hidden)
        rebound = _rebound_loaders(namespace, values)
        plane = self._data_plane(values, options, world, device)
        if hasattr(self.launcher, "check"):  # before anything is written or started
            workers = sum(i.plan.workers for i in plane.loaders) if plane is not None else 0
            self.launcher.check(world + workers)
        job_id = uuid.uuid4().hex[:12]
        big = BigValues(job_id, resident=True)  # large arrays travel once, through shared memory
        blob = package.ship(values, plane.stand_ins() if plane is not None else None, big)
        for line in ([note] if note else []) + rebound + big.notes:
            sink.write("stderr", line + "\n")

        try:
            job_dir = tempfile.mkdtemp(prefix=f"taas-{job_id}-")
        except OSError as exc:
            big.unlink(wait=False)
            raise _no_room("create the job's directory", exc) from None
        stats = self.last = JobStats(job_id, world, device, backend,
                                     loaders=sorted(i.name for i in plane.loaders) if plane else [],
                                     config=options.config)
        store = handle = None
        layers = _Layers(job_id, job_dir, cwd, options.storage, world > 1 or plane is not None)
        started = time.monotonic()
        try:
            if plane is not None:
                plane.open(job_id, self.launcher.data_transport())
            payload = package.Payload(
                source=source, filename=filename, first_line=first_line, names=blob,
                bound=cell.bound, device=device,
                backend=backend, pg_timeout=float(options.timeout or 1800),
                results=options.results, results_to_cpu=cuda_devices == 0,
                loaders=plane.settings if plane is not None else {},
            )
            try:
                with open(os.path.join(job_dir, "payload.pkl"), "wb") as f:
                    pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
            except OSError as exc:
                raise _no_room("write the job's files", exc) from None
            store = _agent_store(world)
            spec = self._launch_spec(job_id, job_dir, world, store.port, plane, cwd, options.storage,
                                     shared_fds=tuple(big.fds),  # resident big tensors
                                     cleanups=big.cleanups())
            layers.mark()
            handle = self.launcher.start(spec)
            big.close_fds()  # every process has its own now
            show = None if options.show is None else {f"rank{r}" for r in options.show}
            router = OutputRouter(sink, [p.key for p in spec.processes], show, tag=world > 1)
            ends = self._supervise(handle, router, sink, plane, options.timeout, started,
                                   job_dir=job_dir, stall=options.stall, name_for=name_for)
            stats.exit_codes = {k: e.returncode for k, e in ends.items()}
            if any(end.failed for end in ends.values()):
                router.replay_hidden("--- recent output of {key} ---")
                raise _job_failed(job_dir, list(ends.values()), name_for)
            stats.outcome = "ok"
            alone = comm.note(world, stats.comm_ops)
            if alone:
                sink.write("stderr", alone + "\n")
            if plane is not None:
                plane.finish(sink)
                stats.data = plane.summary()
                sink.write("stderr", "".join(line + "\n" for line in stats.data))
            layers.merge(sink)
            return self._results(job_dir, options)
        except JobFailed:
            stats.outcome = "failed"
            hung = plane.hang(options.timeout, name_for, job_dir) if plane is not None else None
            if hung is not None:
                raise hung from None
            raise
        except KeyboardInterrupt:
            stats.outcome = "interrupted"
            raise
        finally:
            big.unlink(wait=False)  # a rank still running keeps its mapping
            if handle is not None:
                handle.close()
            if plane is not None:
                plane.finish(sink)
                plane.close()  # its transport frees the job's channels
            stats.wall_s = time.monotonic() - started
            store = None  # closes its listening port
            layers.merge(sink)  # a failed or interrupted job's files too, as rank 0's stay
            _remove_tree(job_dir)

    # ------------------------------------------------------------------------------------
    def _data_plane(self, values: dict, options, world: int, device: str):
        """Registered loaders the cell reads leave ``values`` (loader workers get them; the
        ranks get views): their DataPlane, or None."""
        from taas.data.plane import DataPlane

        return DataPlane.plan(values, options, world, device)

    def _launch_spec(self, job_id: str, job_dir: str, world: int, port: int, plane,
                     cwd: str, storage: str = "layer", shared_fds: tuple[int, ...] = (),
                     cleanups: tuple = ()) -> LaunchSpec:
        common = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RUN_ID": job_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TAAS_JOB_DIR": job_dir,
            "MPLBACKEND": "module://taas.worker.mpl_backend",
            "PYTHONUNBUFFERED": "1",
        }
        if "OMP_NUM_THREADS" not in os.environ:
            common["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        lo = _loopback_ifname()
        if lo:  # one machine: every socket on loopback, gloo's and NCCL's bootstrap too
            common["GLOO_SOCKET_IFNAME"] = lo
            common["NCCL_SOCKET_IFNAME"] = lo
        processes = []
        for rank in range(world):
            scratch = os.path.join(job_dir, "scratch", f"rank{rank}")
            os.makedirs(scratch)
            env = dict(common, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                       TAAS_SCRATCH=scratch)
            processes.append(ProcessSpec(key=f"rank{rank}", entry="taas.worker.rank:main", env=env,
                                         storage="shared" if rank == 0 else storage))
        if plane is not None:
            processes.extend(plane.processes(common, storage))
        return LaunchSpec(job_id=job_id, job_dir=job_dir, cwd=cwd, processes=tuple(processes),
                          shared_fds=shared_fds,
                          cleanups=tuple(cleanups) + (plane.cleanups() if plane is not None else ()))

    def _supervise(self, handle, router: OutputRouter, sink, plane, timeout: float | None, started: float,
                   *, job_dir: str | None = None, stall: float = 0.0, name_for=None):
        """Pump output until every process ended; stop all at the first failure.

        Past ``timeout`` and on Ctrl-C the ranks' places (:func:`places`) are taken before
        anything is stopped, and shown with the error; after ``stall`` seconds without output
        from any process they are shown as one line, once per silence, and the job goes on."""
        ends: dict[str, failure.ProcessEnd] = {}
        keys = list(handle.pids)
        stopping = False
        # Event lines can be larger than a pipe's buffer: reassemble them across reads.
        event_lines: dict[str, LineSplitter] = {}
        last_output = time.monotonic()
        stalled = False  # this silence was reported already

        def deliver(events) -> None:
            nonlocal stopping, last_output, stalled
            for event in events:
                if isinstance(event, ProcessExit):
                    ends[event.key] = failure.ProcessEnd(event.key, event.returncode, time.time(),
                                                         stopped=stopping)
                    if event.returncode != 0 and not stopping:
                        stopping = True
                        handle.stop(STOP_GRACE)
                elif event.stream != "events":
                    last_output, stalled = time.monotonic(), False
                    router.feed(event.key, event.stream, event.data)
                else:
                    lines, _ = event_lines.setdefault(event.key, LineSplitter(max_line=None)).feed(event.data)
                    for line in lines:
                        self._on_event(event.key, line, sink, plane)

        def places() -> list[hang.Place]:
            """Where every rank is: the running ones are asked for their stacks (answers are
            awaited up to STACK_WAIT s, output keeps flowing meanwhile), the others ended."""
            ranks = [k for k in keys if k.startswith("rank")]
            self._stacks = {}
            asked = set(stacks.request(job_dir, [k for k in ranks if k not in ends])) if job_dir else set()
            deadline = time.monotonic() + STACK_WAIT
            while asked - set(self._stacks) - set(ends) and time.monotonic() < deadline:
                deliver(handle.events(0.05))
            return [_place(k, self._stacks.get(k), ends.get(k), job_dir) for k in ranks]

        try:
            while len(ends) < len(keys):
                deliver(handle.events(0.05))
                router.tick()
                if (stall and not stopping and not stalled and len(ends) < len(keys)
                        and time.monotonic() - last_output > stall):
                    stalled, since = True, last_output
                    where = places()
                    if not stopping and last_output == since:  # still silent
                        router.tick()
                        sink.write("stderr", f"taas: no output for {stall:g} s; {hang.one_line(where)}\n")
                if timeout is not None and not stopping and time.monotonic() - started > timeout:
                    where = places()  # before anything is stopped
                    if stopping or len(ends) == len(keys):
                        continue  # a rank failed, or all ended, while they answered
                    stopping = True
                    if plane is not None:
                        plane.note_timeout()  # who waited for which loader, before the stop
                    handle.stop(STOP_GRACE)
                    deliver(handle.drain())
                    router.close()
                    left = failure.left_early(list(ends.values()))
                    odd = hang.odd_sentence(where)
                    why = (f" ({failure.left_line(left)})" if left is not None
                           else f" ({odd})" if odd else "")
                    summary = f"the job ran past --timeout {timeout:g}s{why}; all its processes were stopped"
                    raise JobFailed(summary, [failure.RED + failure.BOLD + summary + failure.RESET]
                                    + hang.render(where, name_for))
            deliver(handle.drain())
        except KeyboardInterrupt as exc:
            where = []
            if not stopping:
                try:
                    where = places()  # before anything is stopped
                except KeyboardInterrupt:
                    pass  # a second Ctrl-C: stop at once
            handle.stop(STOP_GRACE)
            router.close()
            if where:
                _explain_interrupt(exc, where, name_for)
            raise
        router.close()
        return ends

    def _on_event(self, key: str, line: str, sink, plane) -> None:
        """One JSON line from a process's events pipe (see taas.worker.events)."""
        try:
            message = json.loads(line)
        except ValueError:
            return
        if message.get("kind") == "display" and hasattr(sink, "display"):
            sink.display(message.get("data", {}), message.get("metadata", {}))
        elif message.get("kind") == "stack":
            self._stacks[key] = message
        elif message.get("kind") == "comm" and self.last is not None:
            self.last.comm_ops[key] = message.get("ops")
        elif str(message.get("kind")).startswith("data.") and plane is not None:
            plane.on_event(key, message, sink)

    def _results(self, job_dir: str, options) -> CellResult:
        result = CellResult()
        if not options.results:
            return result
        try:
            with open(report.result_path(job_dir), "rb") as f:
                raw = pickle.load(f)
        except OSError:
            return result  # rank 0 ended early (sys.exit(0)): nothing to bring back
        for name, blob in raw["values"].items():
            value, why = crossing.load_result(blob)
            if why is None:
                result.values[name] = value
            else:
                result.notes.append(f"taas: `{name}` was not brought back: {why}")
        for name, why in raw["skipped"].items():
            result.notes.append(f"taas: `{name}` was not brought back: {why}")
        if raw["out"] is not None:
            value, why = crossing.load_result(raw["out"])
            if why is None:
                result.out, result.has_out = value, True
            else:
                result.notes.append(f"taas: the cell's result was not brought back: {why}")
        elif raw.get("out_skipped"):
            result.notes.append(f"taas: the cell's result was not brought back: {raw['out_skipped']}")
        return result


class _Layers:
    """The ``--storage layer`` bookkeeping of one job: the working directory's clock before the
    launch, and the merge of every process's layer once all of them have exited."""

    def __init__(self, job_id: str, job_dir: str, cwd: str, storage: str, others: bool):
        self.job_id, self.job_dir, self.cwd = job_id, job_dir, cwd
        self.active = storage == "layer" and others  # a lone rank 0 has no layer
        self.since_ns = 0
        self.done = False

    def mark(self) -> None:
        if self.active:
            self.since_ns = merge.clock_mark(self.cwd) or 0  # 0: every existing file counts as touched

    def merge(self, sink) -> None:
        """Merge the layers into the working directory (once), showing the notes; never raises
        but for Ctrl-C."""
        if not self.active or self.done:
            return
        self.done = True
        root = os.path.join(self.job_dir, "layer")
        try:
            names = sorted(os.listdir(root), key=merge._order)
        except OSError:
            return
        layers = [(name, os.path.join(root, name, "upper")) for name in names
                  if os.path.isdir(os.path.join(root, name, "upper"))]
        conflicts = os.path.join(self.cwd, ".taas", "conflicts", self.job_id)
        try:
            result = merge.merge_layers(self.cwd, layers, self.since_ns, conflicts)
        except Exception as exc:  # never lose the job's result over it
            sink.write("stderr", f"taas: could not merge the ranks' layers back: {exc}\n")
            return
        for line in result.notes():
            sink.write("stderr", line + "\n")


def _remove_tree(path: str) -> None:
    """``rm -rf path``, also through directories without permissions (overlayfs leaves its
    work directory ``d---------``, owned by the rank's user)."""
    def retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)


def _job_failed(job_dir: str, ends: list, name_for) -> JobFailed:
    """The failure report: every process's error file and fault dump, the root cause first."""
    for end in ends:
        end.record = report.read_error(job_dir, end.key)
        end.fault = _read(report.fault_path(job_dir, end.key))
    root = failure.root_cause(ends)
    others = [end for end in ends if end is not root]
    return JobFailed(failure.summary(root), failure.render(root, others, name_for), root)


def _place(key: str, answer: dict | None, end, job_dir: str | None) -> hang.Place:
    """One rank's place: its answer, how it ended, or neither (it did not answer)."""
    if answer is not None:
        return hang.Place.from_event(key, answer)
    if end is None:
        return hang.Place(key)
    if end.returncode == 0:
        record = report.read_error(job_dir, key) if job_dir else None
        return hang.Place(key, ended="already ended (sys.exit(0))" if record else "already ended (code 0)")
    return hang.Place(key, ended=f"already ended ({failure.describe_exit(end)})")


def _explain_interrupt(exc: KeyboardInterrupt, where: list, name_for) -> None:
    """Make the notebook show where the ranks were when the job was interrupted: IPython
    shows an exception's ``_render_traceback_`` instead of its frames (the error's name stays
    KeyboardInterrupt); plain Python shows the note."""
    lines = ["KeyboardInterrupt: the job was interrupted; all its processes were stopped"]
    lines += hang.render(where, name_for)
    exc._render_traceback_ = lambda: list(lines)
    exc.add_note("\n".join(lines[1:]))


def _syntax_error(exc: SyntaxError, name_for) -> CellSyntaxError:
    """The cell's SyntaxError as Python shows it, at the cell's own line, without our frames."""
    import traceback

    where = name_for(exc.filename) if name_for and exc.filename else None
    lines = "".join(traceback.format_exception_only(SyntaxError, exc)).rstrip("\n").splitlines()
    if where and lines and lines[0].lstrip().startswith("File "):
        lines[0] = f"  {where}, line {exc.lineno}"
    summary = f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return CellSyntaxError(summary, [failure.RED + summary + failure.RESET] + lines)


def _rebound_loaders(namespace: dict, values: dict) -> list[str]:
    """Notes for names the cell (or a notebook function it calls) reads that referred to a
    registered loader and were assigned again since (see ``registry.rebound``)."""
    from taas.data import registry
    from taas.job.package import _referenced_globals

    if not registry._entries:
        return []
    registry.remember_names(namespace)
    names, seen, stack = set(values), set(), list(values.values())
    while stack:  # globals read by notebook functions and classes, transitively
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for name, ref in _referenced_globals(value).items():
            names.add(name)
            stack.append(ref)
    return registry.rebound(namespace, names)


def _no_room(what: str, exc: OSError) -> LaunchError:
    """The one line for a job whose files cannot go to the temporary directory."""
    return LaunchError(f"cannot {what} in {tempfile.gettempdir()}: {exc.strerror or exc}; free space "
                       "there, or set TMPDIR to a writable directory and restart the kernel")


def working_directory() -> str:
    """The kernel's working directory, where the ranks start; a one-line LaunchError if it
    was deleted (``os.getcwd()`` fails) or cannot be entered."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        try:  # Linux still knows the path it had
            path = os.readlink("/proc/self/cwd").removesuffix(" (deleted)")
        except OSError:
            path = os.environ.get("PWD", "")
        again = " (a new directory of that name is not the same one)" if path and os.path.isdir(path) else ""
        raise LaunchError(
            f"the notebook's working directory {path} no longer exists{again}; `%cd` to an "
            "existing directory and run the cell again".replace("  ", " ")) from None
    if not os.access(cwd, os.X_OK):
        raise LaunchError(f"the notebook's working directory {cwd} cannot be entered "
                          "(permission denied); `%cd` to another directory or fix its "
                          "permissions, and run the cell again")
    return cwd


def _agent_store(world: int):
    """The job's rendezvous store, hosted here (as torchrun's agent does).

    TCPStore's own server listens on every interface (``::``); so we create the listening
    socket ourselves, on 127.0.0.1 only, port 0 (the OS picks: two kernels never race for a
    port), and hand it over as ``master_listen_fd``; from then on the store owns it (and
    closes it when the store is freed)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(min(max(world, 128), socket.SOMAXCONN))
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:  # Ctrl-C included: close the socket the store did not take; re-raised
        listener.close()
        raise
    listener.detach()
    return store


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""
