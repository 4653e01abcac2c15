"""A rank's heartbeat: every second, one ``beat`` event saying what the rank is doing now.

The kernel's live rank panel (:mod:`taas.io.panel`) is drawn from these beats, so it works
wherever the events pipe reaches the kernel (one machine or a cluster's nodes).  A daemon
thread samples, once a second from :func:`start` to :func:`stop`:

    state     starting (before the cell), running, or waiting (in a torch.distributed call, or
              for a registered loader's next unit), debugger / input (at a prompt: the user's turn)
    line      the innermost line of the cell the main thread is at (None: not in the cell)
    call      the torch.distributed call it waits in (``all_reduce``), else the cell's function
              it is in (``train_step``), or at the cell's top level the function that line called
    cpu, rss  this process's CPU % since the last beat and its resident memory (psutil)
    gpu_mem   bytes torch allocated on this rank's GPU (None on CPU, or before CUDA is used)
    gpu_util  the GPU's utilisation % from NVML (None where NVML is not installed)
    data      loader name -> [units taken, seconds waited] of this rank's views
    node      GROUP_RANK: the panel groups ranks per node when there are many

Everything here is cheap (a frame walk and two psutil reads: well under a millisecond) and
nothing here stops or slows the main thread; a sample that fails is skipped, never fatal.
The thread is started once per process and serves every cell of a kept rank: a cell's start
only hands it the cell (starting a thread per cell made the main thread wait for the new
thread to run, about a millisecond per kept cell on a busy machine).  Neither a cell's start
nor its stop wakes the thread while it already waits for a beat that is due: it finds the
cell that is current then (each wake costs the main thread the GIL back, with 4 ranks on 2
cores a fraction of a millisecond per kept cell); only a thread idle between cells is woken.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

from taas.launch.process import events
from taas.launch.process.report import _internal

INTERVAL = 1.0  # seconds between beats
# torch.distributed's collectives and point-to-point calls live here (their decorators in
# c10d_logger.py wrap them: the first frame in this file is the call the user made).
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")
_VIEW = os.path.join("taas", "data", "view.py")
_running = threading.Event()  # the cell has started
_sending = threading.Lock()  # a beat is sent whole before stop() returns, never after


class _Cell:
    """One cell to beat for: the main thread, the cell's file, the device, when the next beat
    is due, and whether the cell is over (set under ``_sending``; the beating thread is not
    woken for it: it finds out when its next beat is due)."""

    __slots__ = ("main", "filename", "device", "due", "stopped")

    def __init__(self, main: int, filename: str, device: str, due: float):
        self.main, self.filename, self.device, self.due = main, filename, device, due
        self.stopped = False


_cell: _Cell | None = None  # the cell being beaten for (each start has its own: see start)
# The beating thread of this process (None: not started, or started before a fork), and the
# cells it is handed, in turn, when it waits for none (``_idle``: under ``_sending``).
_thread: threading.Thread | None = None
_cells: queue.SimpleQueue = queue.SimpleQueue()
_idle = False


def start(filename: str, device: str) -> None:
    """Beat from now on (call it from the rank's main thread); ``filename`` is the cell's.
    A kept rank calls it again for each cell, after :func:`stop` at the end of the last one:
    between cells it sends nothing (nobody reads its events then).  Each cell has its own
    :class:`_Cell`, so a kept rank's next cell never revives the beats of the one before."""
    global _cell, _idle
    cell = _Cell(threading.get_ident(), filename, device, time.monotonic() + INTERVAL)
    _running.clear()
    beater = _beater()
    with _sending:
        if _cell is not None:
            _cell.stopped = True  # an earlier cell's beats end (a start without a stop)
        _cell = cell
        # A thread waiting for an earlier cell's beat finds this cell then (that beat is due
        # before this one's first): only an idle thread needs the wake.
        wake, _idle = _idle, False
    if wake:
        beater.put(cell)


def _beater() -> queue.SimpleQueue:
    """The queue of this process's beating thread, started on first use (a forked process
    has none of its parent's threads: it starts its own, with a queue of its own)."""
    global _thread, _cells, _idle
    if _thread is None or not _thread.is_alive():
        _cells = queue.SimpleQueue()
        with _sending:
            _idle = True  # it starts waiting for its first cell
        _thread = threading.Thread(target=_serve, args=(_cells,), name="taas-heartbeat", daemon=True)
        _thread.start()
    return _cells


def _serve(cells: queue.SimpleQueue) -> None:
    """The beating thread: each cell beaten until it is over, then the one current then;
    with none, it waits to be handed the next one (it wakes for nothing else)."""
    cell = cells.get()
    while True:
        cell = _beat(cell, cells)


def _next(cell: _Cell, cells: queue.SimpleQueue) -> _Cell:
    """The cell to beat for after ``cell`` (over): the current one, or the next one handed
    over, waited for."""
    global _idle
    with _sending:
        current = _cell
        if current is not None and current is not cell and not current.stopped:
            return current  # started while we waited for a beat: it was not handed over
        _idle = True
    return cells.get()


_prompt: list[str] = []  # "debugger" or "input" while the main thread waits for the user


class prompting:
    """``with prompting("debugger"):`` beats say that state (the rank waits for the user at a
    prompt, :mod:`taas.rank.console`), whatever the stack looks like."""

    def __init__(self, state: str):
        self.state = state

    def __enter__(self) -> None:
        _prompt.append(self.state)

    def __exit__(self, *exc) -> None:
        _prompt.pop()


def running() -> None:
    """The cell starts now: beats say ``running`` (or ``waiting``) from here on."""
    _running.set()


def stop() -> None:
    """No beats after this returns (the rank is done: the kernel's panel says so from its own
    events; a kept rank's cell is over, and a beat then would wait in the pipe for the next).
    The beating thread is not woken: waking it cost the cell's end about a millisecond on a
    busy machine (the main thread preempted by it), and it sees the mark when its next beat
    is due."""
    with _sending:
        if _cell is not None:
            _cell.stopped = True


def gpu_memory(gpu: int | None) -> int | None:
    """Bytes torch's tensors hold on CUDA device ``gpu`` (the panel's and ``%taas``'s figure),
    or None: no GPU, or CUDA not initialised by the cell (never initialised from here)."""
    torch = sys.modules.get("torch")
    if gpu is None or torch is None or not torch.cuda.is_initialized():
        return None
    # The device explicitly: a helper thread's current device is not the main thread's.
    return int(torch.cuda.memory_allocated(gpu))


def _beat(cell: _Cell, cells: queue.SimpleQueue) -> _Cell:
    """Beat for ``cell`` until it is over; the next cell.  The first beat is due a second in:
    the panel shows from two seconds into a job, and a cell that ends sooner never pays for
    psutil's import and a first sample.  A cell started meanwhile (its start marked this one
    over) is taken when this one's beat is due, which is before that cell's first."""
    sampler = None
    while True:
        pause = cell.due - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # the beat is due then (nothing hands us a cell while we wait)
        if cell.stopped:
            return _next(cell, cells)
        try:
            if sampler is None:
                sampler = Sampler(cell.main, cell.filename, cell.device)
            fields = sampler.sample()
        except Exception:  # psutil or torch failed once: no beat this second, try again
            fields = None
        if fields is not None:
            with _sending:
                if not cell.stopped:
                    events.send("beat", **fields)
        cell.due = time.monotonic() + INTERVAL


class Sampler:
    """One rank's figures, sampled on demand (:meth:`sample`)."""

    def __init__(self, main: int, filename: str, device: str):
        import psutil

        self.main, self.filename = main, filename
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first reading only starts the measure
        self.gpu = int(os.environ.get("LOCAL_RANK", "0")) if device == "cuda" else None
        self.nvml = self.gpu is not None  # turned off at the first failure
        self.node = int(os.environ.get("GROUP_RANK", "0") or 0)

    def sample(self) -> dict:
        state, line, call = where(self.main, self.filename)
        if not _running.is_set() and call != "data":  # waiting for the first slice stays "waiting"
            state = "starting"
        if _prompt:
            state = _prompt[-1]
        return {"state": state, "line": line, "call": call, "node": self.node,
                "cpu": round(self.process.cpu_percent(None), 1),
                "rss": self.process.memory_info().rss,
                "gpu_mem": self._gpu_memory(), "gpu_util": self._gpu_utilisation(),
                "data": _data_figures()}

    def _gpu_memory(self) -> int | None:
        return gpu_memory(self.gpu)

    def _gpu_utilisation(self) -> int | None:
        torch = sys.modules.get("torch")
        if not self.nvml or torch is None:
            return None
        try:
            return int(torch.cuda.utilization(self.gpu))
        except Exception:  # no pynvml (or no NVML library): blank from now on
            self.nvml = False
            return None


def where(thread_id: int, filename: str) -> tuple[str, int | None, str]:
    """(state, cell line, call) of thread ``thread_id`` now: ``waiting`` in a torch.distributed
    call (``all_reduce``, not its wrappers) or in a loader view's wait for data; else
    ``running``, and the function the rank is in (see below)."""
    frame = sys._current_frames().get(thread_id)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    stack.reverse()  # outermost first
    line = None
    for f in stack:
        if f.f_code.co_filename == filename:
            line = f.f_lineno
    for f in stack:
        name = f.f_code.co_filename
        if name.endswith(_C10D):
            return "waiting", line, f.f_code.co_name
        if name.endswith(_VIEW) and f.f_code.co_name in ("first", "_await_prefetch"):
            return "waiting", line, "data"  # a registered loader's next unit is not here yet
    # The function of the cell the rank is in (``train_step``); at the cell's top level, the
    # function that line called (``fit``): what the user wrote, not a library's innards.
    outside = [f for f in stack if not _internal(f.f_code.co_filename)]
    cell = [i for i, f in enumerate(outside) if f.f_code.co_filename == filename]
    if not cell:
        return "running", line, outside[-1].f_code.co_name if outside else ""
    call = outside[cell[-1]].f_code.co_name
    if call == "<module>":
        call = outside[cell[-1] + 1].f_code.co_name if cell[-1] + 1 < len(outside) else ""
    return "running", line, call


def _data_figures() -> dict:
    views = sys.modules.get("taas.data.view")
    if views is None:  # the cell reads no registered loader
        return {}
    return {view.name: [view._units, round(view._wait, 3)] for view in list(views._views)}
