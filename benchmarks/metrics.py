"""``taas.log`` cost per call in a rank, side by side with what it replaces, in one process.

    python benchmarks/metrics.py [--calls 100000] [--scalars 3] [--repeat 5]

Measured in a forked child set up as a rank is (an events pipe read by the parent, the rank's
buffer installed by :func:`taas.rank.metrics.install`), per call, median of ``--repeat`` runs:

    dict.update         what a loop that only keeps its scalars pays (the floor)
    taas.log            the call a cell makes: checks the values, appends a row; a thread sends
    events.send         one event line per call: what taas.log would cost without the buffer
    taas.log + flush    taas.log, plus the time to send what is still buffered at the end

Also the plot: :func:`taas.io.plot.render` of 10,000 steps of ``--scalars`` series (decimated
to 2,000 points each), which the kernel does at most once a second.  The ratios are printed;
nothing is asserted (these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _drain(fd: int) -> None:
    while os.read(fd, 1 << 16):
        pass


def _child(calls: int, scalars: int, repeat: int, out: int) -> None:
    import taas
    from taas.launch.process import events
    from taas.rank import metrics

    buffer = metrics.install()
    names = [f"s{i}" for i in range(scalars)]

    def values(i: int) -> dict:
        return {name: i * 0.001 + k for k, name in enumerate(names)}

    def plain() -> None:
        kept: dict = {}
        for i in range(calls):
            kept.update(values(i))

    def logged() -> None:
        for i in range(calls):
            taas.log(step=i, **values(i))

    def flushed() -> None:
        logged()
        buffer.flush()

    def per_event() -> None:
        for i in range(calls):
            events.send("metrics", rows=[[i, values(i)]])

    figures = {}
    for name, run in (("dict.update", plain), ("taas.log", logged), ("events.send", per_event),
                      ("taas.log + flush", flushed)):
        times = []
        for _ in range(repeat):
            buffer.flush()
            started = time.perf_counter()
            run()
            times.append((time.perf_counter() - started) / calls)
        figures[name] = statistics.median(times)
    os.write(out, json.dumps(figures).encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--scalars", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    events_read, events_write = os.pipe()
    result_read, result_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(events_read)
            os.close(result_read)
            os.environ["TAAS_EVENTS_FD"] = str(events_write)
            _child(args.calls, args.scalars, args.repeat, result_write)
            code = 0
        finally:
            os._exit(code)
    os.close(events_write)
    os.close(result_write)
    reader = threading.Thread(target=_drain, args=(events_read,), daemon=True)
    reader.start()
    figures = json.loads(os.read(result_read, 1 << 16) or b"{}")
    os.waitpid(pid, 0)
    if not figures:
        raise SystemExit("the measuring process failed")
    floor = figures["dict.update"]
    print(f"per call, {args.scalars} scalars, {args.calls} calls, median of {args.repeat}:")
    for name, seconds in figures.items():
        print(f"  {name:18s} {seconds * 1e6:8.2f} us   x{seconds / floor:6.1f} dict.update")
    print(f"  events.send per call / taas.log: x{figures['events.send'] / figures['taas.log']:.1f}")

    from taas.io import plot

    series = {f"s{k}": (list(range(10_000)), [1.0 / (i + 1) + k for i in range(10_000)])
              for k in range(args.scalars)}
    started = time.perf_counter()
    png = plot.render(series, "bench")
    print(f"plot of 10,000 steps x {args.scalars} scalars: {(time.perf_counter() - started) * 1e3:.0f} ms, "
          f"{len(png) // 1024} KiB PNG")


if __name__ == "__main__":
    main()
