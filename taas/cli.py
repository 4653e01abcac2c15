"""``taas``: this user's detached jobs from a terminal, with no notebook.

    taas jobs              id, state, ranks, where, started, how long, size, notebook, cell
    taas logs ID [-f]      the job's output (collapsed across ranks as the cell showed it);
                           -f: then follow it until it ends (Ctrl-C stops following)
    taas attach ID         the latest output, then live, with the rank panel as text; Ctrl-C
                           leaves the job running; rank 0's results stay for a notebook
    taas cancel ID         stop every rank and loader worker
    taas forget ID         drop a finished job's record

    taas --cluster ADDRESS ...   the same on a Ray cluster's detached jobs (taas.host.ray):
                           ADDRESS as ``%taas cluster`` takes it

The terminal face of :mod:`taas.host.client`, as :mod:`taas.magics` is the notebook's.
"""

from __future__ import annotations

import argparse
import signal
import sys

from taas.errors import RenderedError, TaasError
from taas.host import client
from taas.jobs import listing
from taas.jobs.store import JobError, Store
from taas.leases import inventory
from taas.leases.wait import machine_lines


class TerminalView:
    """A Sink for a terminal: lines as they come, progress bars and the rank panel in place
    (redrawn below the output when the terminal takes cursor moves, else printed when final)."""

    def __init__(self, out=None, live: bool | None = None):
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._bars: dict = {}
        self._panel: list[str] = []
        self._drawn = 0  # lines of bars and panel below the output

    def _erase(self) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self) -> None:
        if not self.live:
            return
        lines = list(self._bars.values()) + self._panel
        if lines:
            self.out.write("\n".join(lines) + "\n")
        self._drawn = len(lines)

    def write(self, stream: str, text: str) -> None:
        self._erase()
        self.out.write(text)
        self._draw()
        self.out.flush()

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        self._erase()
        if final:
            self._bars.pop((key, stream), None)
            self.out.write(text + "\n")
        else:
            self._bars[(key, stream)] = text
        self._draw()
        self.out.flush()

    def panel(self, bundle: dict, metadata: dict, final: bool) -> None:
        self._erase()
        self._panel = [] if final else str(bundle.get("text/plain", "")).splitlines()
        self._draw()
        self.out.flush()

    def close(self) -> None:
        self._erase()
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taas", description="Your detached taas jobs (%%taas --detach).")
    parser.add_argument("--cluster", metavar="ADDRESS", help="the jobs detached on this Ray cluster "
                        "(what ray.init(address=...) takes), not this machine's")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    verbs.add_parser("jobs", help="list your jobs")
    logs = verbs.add_parser("logs", help="print a job's output")
    logs.add_argument("id")
    logs.add_argument("-f", "--follow", action="store_true", help="then follow it until it ends")
    for verb, text in (("attach", "follow a job live (Ctrl-C leaves it running)"),
                       ("cancel", "stop a job: every rank and loader worker"),
                       ("forget", "drop a finished job's record")):
        verbs.add_parser(verb, help=text).add_argument("id")
    args = parser.parse_args(argv)
    if sys.stdin.isatty():  # a person at a terminal: Ctrl-C stops following, even where the
        # process was started with SIGINT ignored (Python then installs no handler of its own)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.cluster:
            from taas.host.ray import client as cluster_jobs

            cluster = cluster_jobs.connect(args.cluster)
            store = cluster_jobs.store_for(cluster)
            return _run(store, args, cluster)
        return _run(Store(), args)
    except JobError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except TaasError as exc:
        print(f"taas: {exc}", file=sys.stderr)
        return 1


def _run(store, args, cluster=None) -> int:
    """``args``' command on ``store``: this machine's records, or (``cluster``) a Ray cluster's."""
    if args.verb == "jobs":
        print(listing.render(store.listing()))
        if cluster is None:
            for line in machine_lines(inventory.gpus(fallback=False)):  # NVML's GPUs, or the leases alone
                print(line)
        return 0
    job_id = store.resolve(args.id)
    if args.verb == "cancel":
        if cluster is not None:
            from taas.host.ray import client as cluster_jobs

            record = cluster_jobs.cancel(cluster, store, job_id)
        else:
            record = client.cancel(store, job_id)
        print(f"taas: job {job_id} {record.state.value}")
        return 0 if record.state.value == "cancelled" else 1
    if args.verb == "forget":
        store.remove(job_id)
        print(f"taas: job {job_id} forgotten")
        return 0
    view = TerminalView(live=False if args.verb == "logs" else None)
    try:
        if args.verb == "logs" and not args.follow:
            client.Follower(store, job_id, view).finish()
            return 0
        record = client.follow(store, job_id, view, latest=None if args.verb == "logs" else client.LATEST)
    except KeyboardInterrupt:
        view.close()
        print(f"\ntaas: stopped following job {job_id}; it goes on (taas attach {job_id})", file=sys.stderr)
        return 130
    view.close()
    print(_ending(store, record), file=sys.stderr)
    return 0 if record.state.value in ("done", "kept") else 1


def _ending(store, record) -> str:
    if record.state.value == "done":
        waiting = " (rank 0's results wait for a notebook: %taas attach " + record.id + ")" \
            if record.has_results and record.taken is None else ""
        return f"taas: job {record.id} done{waiting}"
    if record.state.value == "kept":
        return (f"taas: job {record.id}'s cell ended; its kept ranks wait for a notebook: "
                f"%taas attach {record.id} makes them its kept ranks (taas cancel {record.id} ends them)")
    try:
        client.raise_failure(store, record)
    except RenderedError as exc:
        return "\n".join(exc.rendered)
    except TaasError as exc:
        return str(exc)
    return f"taas: job {record.id} {record.state.value}"


if __name__ == "__main__":
    sys.exit(main())
