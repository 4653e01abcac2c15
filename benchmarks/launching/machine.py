"""What this machine charges for a wake-up: the figure that explains why the same cell costs
milliseconds on one machine and tens of them on another.

A cell on kept ranks crosses processes several times in a row (kernel, job host, ranks, and
back); each crossing wakes a process, often on the other CPU.  On a virtual machine whose idle
CPUs halt, waking one costs a trip through the hypervisor: tens to hundreds of microseconds
instead of a few.  A benchmark that prints a ratio prints this beside it, measured in the same
run: a pipe round trip between two processes on different CPUs, back to back and after each
side slept (its CPU idle), and on one CPU.

Some virtual machines also let a process's memory go cold while it sleeps (the hypervisor's
doing: pages that cost a fault through it to touch again).  Then a cell after a pause of a
second costs several times what it costs back to back, in every process it crosses, whatever
the code.  :func:`cold_memory` measures that beside the wake-up: the same reads of a process's
own memory, right after it touched it and after it slept.
"""

from __future__ import annotations

import os
import statistics
import time


def _round_trips(cpus: tuple[int, int], count: int, pause: float) -> float:
    """The median round trip, in microseconds, between a process on ``cpus[0]`` and one on
    ``cpus[1]`` (a byte each way through pipes), ``pause`` seconds apart."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:  # the echo
        try:
            os.sched_setaffinity(0, {cpus[1]})
            for _ in range(count):
                os.read(to_child, 1)
                os.write(from_child, b"x")
        finally:
            os._exit(0)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        times = []
        for _ in range(count):
            if pause:
                time.sleep(pause)
            started = time.perf_counter()
            os.write(from_parent, b"x")
            os.read(to_parent, 1)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e6
    finally:
        os.waitpid(pid, 0)
        for fd in (to_child, from_parent, to_parent, from_child):
            os.close(fd)


def _touch(buffer: bytearray, stride: int) -> float:
    """Milliseconds to read one byte every ``stride`` bytes of ``buffer``."""
    started = time.perf_counter()
    total = 0
    for at in range(0, len(buffer), stride):
        total += buffer[at]
    return (time.perf_counter() - started) * 1e3


def cold_memory(mib: int = 64, stride: int = 64 << 10, rounds: int = 3) -> str:
    """One line: reading ``mib`` MiB of this process's own memory (a byte every ``stride``
    bytes: 1,024 pages) just after touching it, after 50 ms asleep and after 1 s asleep."""
    buffer = bytearray(b"x" * (mib << 20))  # every page written: mapped, ours
    figures = []
    for pause in (0.0, 0.05, 1.0):
        times = []
        for _ in range(rounds):
            _touch(buffer, 4096)  # every page hot again
            if pause:
                time.sleep(pause)
            times.append(_touch(buffer, stride))
        figures.append(statistics.median(times))
    hot, short, long = figures
    return (f"  memory   reading {len(buffer) // stride:,} pages a process touched: {hot:.2f} ms at once, "
            f"{short:.2f} ms after 50 ms asleep, {long:.2f} ms after 1 s asleep (a VM whose memory goes "
            "cold while idle: every cell after a pause pays that in each process it crosses)")


def wake_cost() -> str:
    """Two lines: this machine's cost of a wake-up, and of memory gone cold (see the module's
    docstring)."""
    allowed = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    try:
        same = _round_trips((allowed[0], allowed[0]), 2000, 0.0)
        if len(allowed) < 2:
            return f"  machine  one CPU: a pipe round trip between two processes {same:.0f} us\n" + cold_memory()
        other = (allowed[0], allowed[1])
        busy = _round_trips(other, 2000, 0.0)
        idle = _round_trips(other, 40, 0.05)
    finally:
        os.sched_setaffinity(0, before)
    return (f"  machine  a pipe round trip between two processes: on one CPU {same:.0f} us | on two CPUs "
            f"{busy:.0f} us back to back, {idle:.0f} us after 50 ms asleep (a wake of an idle CPU; "
            "each cross-process hop of a cell pays about half of that)\n" + cold_memory())


if __name__ == "__main__":
    print(wake_cost())
