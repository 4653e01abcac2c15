"""The rank runtime: what one rank does, from fork to exit.

    load payload -> device, patches -> default process group + start-up barrier
    -> data views -> exec the cell -> report "comm" -> (rank 0) results -> exit code

Rank 0's results are :mod:`taas.job.results`' format, written by :func:`report.write_result`.

Runs in a process forked by the start process, which already set up stdout/stderr, the
environment (torchrun's variables), the working directory and the storage rule; see
:mod:`taas.launch.local.starter`.  Every way out but the end of the cell writes a report
(:mod:`taas.launch.process.report`; ``sys.exit`` too, code 0 included, so the kernel knows where a rank
left) and returns an exit code; a signal death leaves faulthandler's dump instead.

Every rank passes one barrier right after ``init_process_group``, before the cell: gloo's init
can return on one rank before a peer finished connecting to it, and a rank that left then
would fail the peer's init.  After that, a rank that ends never joins a collective: a barrier
on the way out would pair with a peer's pending ``all_reduce`` and hang the job.
"""

from __future__ import annotations

import builtins
import datetime
import faulthandler
import linecache
import logging
import os
import pickle
import sys

import torch
import torch.distributed as dist

from taas.job import crossing, devices, results
from taas.job.analysis import compile_cell
from taas.job.api import PAYLOAD
from taas.job.package import Payload, unship
from taas.launch.process import cells, events, report, stacks, stdin
from taas.rank import comm, console, display, heartbeat, keep, metrics, nccl, patches, shell

log = logging.getLogger(__name__)


def main(spec) -> int:
    # Long on purpose: a rank's whole life in order (set-up, the cell, results, teardown) under
    # one try, so that every way out (an exception, sys.exit, a signal) ends the same way.
    job_dir = os.environ["TAAS_JOB_DIR"]
    key = spec.key
    rank = int(os.environ["RANK"])
    fault_file = open(report.fault_path(job_dir, key), "w")
    faulthandler.enable(file=fault_file, all_threads=False)
    payload: Payload | None = None
    try:
        with open(os.path.join(job_dir, PAYLOAD), "rb") as f:
            payload: Payload = pickle.load(f)
        _log_to_stderr(payload.log_level)
        log.debug("rank %d of %s: %s on %s/%s, storage %s, loaders %s", rank, os.environ.get("WORLD_SIZE"),
                  payload.filename, payload.device, payload.backend, os.environ.get("TAAS_STORAGE", "shared"),
                  ", ".join(payload.loaders) or "none")
        stacks.start(job_dir, key, payload.filename)  # where this rank is, when the kernel asks
        stdin.setup(job_dir, key)  # input() and pdb ask the notebook (taas.rank.console)
        # A kept rank's channel exists before it is up: the kernel may send the next cell as
        # soon as every rank said done (taas.rank.keep).
        inbox = cells.Inbox(job_dir, key) if keep.kept() else None
        events.send("up")  # the supervisor's --stall clock starts once every rank is up
        heartbeat.start(payload.filename, payload.device)  # the kernel's live rank panel
        if rank == 1 and os.environ.get("TAAS_STORAGE_WARNING"):  # ranks > 0 have it; say it once
            print(f"taas: warning: {os.environ['TAAS_STORAGE_WARNING']}", file=sys.stderr)
        _setup(payload)
        # Notebook CUDA values land on this rank's own device (cuda:LOCAL_RANK), once per storage.
        place = devices.placement(payload.device, int(os.environ.get("LOCAL_RANK", "0")))
        namespace = unship(payload.names, resolve=_loader_view, place=place)
        namespace.update(
            __name__="__main__", __builtins__=builtins, display=display.display
        )
        namespace.setdefault("get_ipython", crossing.get_ipython)
        if inbox is not None:  # --keep: this cell, then the next ones, until released (views per cell)
            keep.run(job_dir, key, rank, payload, namespace, _run_cell, None)
            code = keep.serve(job_dir, key, rank, inbox, namespace, _run_cell, _loader_view)
            _teardown()
            return code
        _install_data_views(payload, namespace)
        heartbeat.running()
        before = results.Before(namespace) if rank == 0 and payload.results else None
        out = _run_cell(payload, namespace)
        comm.report()
        log.debug("cell done on rank %d", rank)
        if before is not None:  # rank 0: every name the cell bound, however (results.Before)
            # The kernel reads big storages out of this process, asked on the job's channel
            # (one machine), before rank 0 goes on.
            report.write_result(job_dir, results.encode(
                results.collect(namespace, before.bound(namespace, payload.bound), out,
                                to_cpu=payload.results_to_cpu, channel=results.channel_from(os.environ))))
        _teardown(done=True)
        return 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)  # sys.exit("message"), as Python prints it
        if code == 0:
            comm.report()
        report.write_error(job_dir, key, exc, code, f"exited with code {code} (sys.exit)")
        _teardown()
        return code
    except BaseException as exc:  # the user's error, or KeyboardInterrupt
        if console.quitting(exc):  # q in the debugger: the job stops, in one line
            report.write_error(job_dir, key, None, 1, console.QUIT)
        else:
            if payload is not None and payload.post_mortem and not isinstance(exc, KeyboardInterrupt):
                console.post_mortem(exc)  # IPython's %pdb on: before the job ends
            report.write_error(job_dir, key, exc, 1)
        _teardown()
        return 1
    finally:
        faulthandler.disable()


def _log_to_stderr(level: int | None) -> None:
    """The kernel's ``taas`` logger was turned below WARNING: log at that level to this rank's
    stderr (the cell, tagged ``[rankN]``).  Otherwise nothing: ranks stay silent by default."""
    if level is None:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("taas")
    logger.addHandler(handler)
    logger.setLevel(level)


def _setup(payload: Payload) -> None:
    world = int(os.environ["WORLD_SIZE"])
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    device_id = None
    if payload.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    else:
        # What `accelerate launch --cpu` sets: Accelerator() and Hugging Face's Trainer then run
        # as the job's ranks on CPU (MULTI_CPU) instead of one process each.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    patches.install(payload.device)
    metrics.install()  # taas.log, and Trainers' logs, to the kernel
    if payload.backend == "nccl":  # a fault or a stop must not leave us spinning in a collective
        nccl.prepare_environment(os.environ)
        nccl.install_stop()
    dist.init_process_group(
        backend=payload.backend,
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=datetime.timedelta(seconds=payload.pg_timeout),
        device_id=device_id,
    )
    if world > 1:
        dist.barrier()  # every rank is connected before any can leave (see the docstring)
    comm.install()
    display.install(rank=int(os.environ["RANK"]), formatter=payload.display_formatter)
    console.install(int(os.environ["RANK"]))  # input(), breakpoint(), pdb: the notebook's input box


def _loader_view(name: str):
    """What a registered loader's stand-in (:class:`taas.job.package.StandIn`) refers to here:
    this rank's view of it (packaging, a layer below, leaves the lookup to us)."""
    from taas.data.view import view_named

    return view_named(name)


def _install_data_views(payload: Payload, namespace: dict) -> None:
    """Replace registered loaders the cell uses by this rank's view of the data plane."""
    if not payload.loaders:
        return
    from taas.data.view import install_views

    install_views(payload.loaders, namespace)


def _run_cell(payload: Payload, namespace: dict):
    text = payload.text or payload.source  # tracebacks show the cell as typed (`%run ...`)
    linecache.cache[payload.filename] = (
        len(text),
        None,
        ["\n"] * (payload.first_line - 1) + text.splitlines(keepends=True),
        payload.filename,
    )
    shell.install(namespace)  # what the cell's IPython syntax calls (taas.job.syntax.route)
    body, last = compile_cell(payload.source, payload.filename, payload.first_line)
    try:
        exec(body, namespace)
        if last is not None:
            return eval(last, namespace)
        return None
    finally:
        metrics.flush()  # every row the cell logged reaches the kernel before "done"


def _teardown(done: bool = False) -> None:
    """On every way out: no collective here (see the module docstring).

    ``done``: the cell ran to its end.  Once everything the kernel needs from this rank is out
    (output flushed, results written, the views' figures sent) the rank says so; when every
    rank has, the supervisor ends the processes itself instead of waiting for each to free its
    process group (gloo's destructor takes ~10 ms per peer connection) and exit."""
    views = sys.modules.get("taas.data.view")
    if views is not None:  # first: loader workers must not wait for a rank that is leaving
        views.close_views()
    heartbeat.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    if done:
        events.send("done")
    if dist.is_initialized() and nccl.leaving():  # (False: a SIGTERM's abort has the groups)
        try:
            if not done and dist.get_backend() == "nccl":
                # Leaving on an error: a collective may still be in flight towards a peer that
                # will never answer; destroying would wait for it, aborting does not.
                nccl.abort_process_groups()
            else:
                dist.destroy_process_group()
        except Exception:  # any backend error here follows an earlier failure
            pass  # a peer failed; the supervisor reports that failure, not this one
