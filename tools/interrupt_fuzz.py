"""Cells interrupted at random moments: a stress run for what a Ctrl-C may leave half done.

    python tools/interrupt_fuzz.py [--seconds 120] [--seed 0]

A Session with the kernel's real job host runs 2-rank cells one after another -- plain ones,
ones whose rank 1 fails twice under ``--max-restarts 3``, and cells on kept ranks -- while a
thread sends this process SIGINT (what a kernel interrupt is) after a random delay from 0 to
1 s.  Every cell must end as it ran, interrupted, or with its own error; the job host must live
through it all; and this process's open descriptors must stop growing once kept ranks have held
theirs.  Printed: each cell that ends otherwise, each new peak of descriptors with what they
are, and the counts of outcomes; the exit status is 1 if anything went wrong.

Not part of the test suite (it runs for minutes and its interrupts land where chance puts them):
the bugs it found each have a test that raises the interrupt at the exact line.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from taas import directive
from taas.host.remote import KernelHost
from taas.session import Session
from tests.support.sinks import Recorder

CELLS = {
    "plain": ("import os, time\nprint('r', os.environ['RANK'], flush=True)\ntime.sleep(0.05)\ny = 1\n",
              "--gpus 2"),
    "restarts": ("import os\nif os.environ['RANK'] == '1' and int(os.environ['TORCHELASTIC_RESTART_COUNT']) < 2:\n"
                 "    raise RuntimeError('again')\ny = 1\n", "--gpus 2 --max-restarts 3"),
    "kept": ("import time\ntime.sleep(0.05)\nz = 1\n", "--gpus 2 --keep"),
}
OWN_ERROR = "JobFailed: rank1 failed: RuntimeError: again"  # a restarts cell that ran out of time
DELAYS = [0, 0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]  # scaled by random(): many land early
SETTLED_AFTER = 20  # cells, and kept ranks seen once (their results channel holds four fds)


def descriptors() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stuck", type=float, default=60.0,
                        help="a cell still running after this many seconds: every thread's stack printed")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main_thread = threading.main_thread().ident
    rnd = random.Random(args.seed)
    session = Session()
    session.job_host = KernelHost()
    session.warm()
    host_pid = session.job_host.proc.pid
    outcomes: collections.Counter = collections.Counter()
    failed = False
    peak, settled, before, kept_seen = 0, None, descriptors(), False
    deadline = time.monotonic() + args.seconds
    cell = 0
    try:
        while time.monotonic() < deadline:
            cell += 1
            kind = rnd.choice(["plain", "restarts", "kept", "kept"])
            source, options = CELLS[kind]
            delay = rnd.choice(DELAYS) * rnd.random()

            def fire(after: float) -> None:
                time.sleep(after)
                signal.pthread_kill(main_thread, signal.SIGINT)

            started = time.monotonic()
            faulthandler.dump_traceback_later(args.stuck)  # a cell that hangs says where
            try:
                threading.Thread(target=fire, args=(delay,), daemon=True).start()
                session.run_cell(source, {}, directive.parse_options(options), sink=Recorder())
                outcome = "ran"
            except KeyboardInterrupt:
                outcome = "interrupted"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {str(exc)[:120]}"
            finally:
                faulthandler.cancel_dump_traceback_later()
            try:  # the SIGINT may come after the cell ended: it must not end this loop
                time.sleep(max(0.0, delay - (time.monotonic() - started)) + 0.01)
            except KeyboardInterrupt:
                pass
            outcomes[(kind, outcome)] += 1
            if time.monotonic() - started > args.stuck:
                failed = True
                print(f"#{cell} {kind} interrupted after {delay:.4f} s took {time.monotonic() - started:.0f} s",
                      flush=True)
            if outcome not in ("ran", "interrupted", OWN_ERROR):
                failed = True
                print(f"#{cell} {kind} interrupted after {delay:.4f} s -> {outcome}", flush=True)
            if session.job_host.proc is None or session.job_host.proc.pid != host_pid:
                failed = True
                print(f"#{cell} the job host ended", flush=True)
                host_pid = session.job_host.proc.pid if session.job_host.proc else None
            now = descriptors()
            if len(now) > peak:
                new = {fd: what for fd, what in now.items() if before.get(fd) != what}
                print(f"#{cell} {kind}: {len(now)} descriptors open, new: {new}", flush=True)
                peak = len(now)
                if settled is not None:
                    failed = True  # grown after the kept ranks settled: a leak
            before = now
            kept_seen = kept_seen or session.kept is not None
            if settled is None and cell >= SETTLED_AFTER and kept_seen:
                settled = peak
    finally:
        for (kind, outcome), count in sorted(outcomes.items()):
            print(f"{kind:9} {outcome:50} {count}")
        try:
            if session.kept is not None:
                session.release()
        finally:
            session.close()
    print(f"{cell} cells; descriptors at the end {len(descriptors())} (peak {peak}, settled {settled})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
