"""What runs in a child the start process forked, before a job's entry point takes over.

A child is forked either on demand for one process of a job (:func:`run`), or ahead of time
(:func:`wait_ready`: "taas-ready" in ps, idle and single-threaded until a job's process is
handed to it).  Either way it becomes a clean process: the leader of its own process group,
its pipes on fds 1 and 2, none of the start process's private fds, default signal handlers,
the job's storage rule applied (:mod:`taas.workdir.storage`), and SIGKILL if the start process
dies (PR_SET_PDEATHSIG, asked after any namespace change, which resets it).  It never returns
into the start process's code: every way out is ``os._exit``.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys

from taas.launch.local import protocol, unix

EX_SOFTWARE = 70  # the exit code when the child's own setup fails


def wait_ready(channel: socket.socket, private: tuple[int, ...], starter: int) -> None:
    """A child forked ahead: wait for a job's process spec, then become that process."""
    try:
        os.setpgid(0, 0)
        unix.set_name("taas-ready")
        signal.set_wakeup_fd(-1)
        for fd in private:
            os.close(fd)
        unix.prctl(unix.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != starter:
            os._exit(0)
        data, fds, _, _ = socket.recv_fds(channel, protocol.READY_MESSAGE_MAX,
                                          len(protocol.STREAMS) + protocol.MAX_SHARED_FDS)
        channel.close()
    except BaseException:  # a child forked ahead must never return into the start process's code
        os._exit(EX_SOFTWARE)
    if not data:  # the start process is done with us
        os._exit(0)
    message = protocol.decode(data)
    if not isinstance(message, protocol.Become):  # logged by decode; the starter sees us exit
        os._exit(EX_SOFTWARE)
    run(message.spec, message.cwd, fds, (), starter)


def apply_storage(spec, cwd: str) -> tuple[str | None, str]:
    """Apply ``spec.storage`` to this (single-threaded, just forked) process: (a one-line
    warning or None, the mode in force: ``shared``, ``layer``, ``strict`` or ``none`` when
    even the read-only rule was refused)."""
    if spec.storage not in ("layer", "strict"):
        return None, "shared"
    from taas.workdir.storage import layer_dir, make_read_only, mount_layer

    job_dir = spec.env.get("TAAS_JOB_DIR", "")
    refused = None
    if spec.storage == "layer" and job_dir:
        refused = mount_layer(cwd, layer_dir(job_dir, spec.key))
        if refused is None:
            return None, "layer"
    warning = make_read_only(cwd, keep_writable=[job_dir] if job_dir else [])
    if refused is None:
        return warning, "strict" if warning is None else "none"
    if warning is None:
        return f"{refused}: read-only for them instead, as with --storage strict", "strict"
    return f"{refused}; {warning}", "none"


def run(spec, cwd: str, fds: list[int], private: tuple[int, ...], starter: int) -> None:
    """Become a clean process for ``spec`` and run its entry; never returns."""
    code = EX_SOFTWARE  # if setup itself fails
    try:
        events = _become(spec, cwd, fds, private, starter)
        os.environ["TAAS_EVENTS_FD"] = str(events)
        os.environ["TAAS_SHARED_FDS"] = ",".join(str(fd) for fd in fds[len(protocol.STREAMS):])
        module, _, function = spec.entry.partition(":")
        code = getattr(importlib.import_module(module), function)(spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child's setup or entry failed: print it, then exit (finally)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _become(spec, cwd: str, fds: list[int], private: tuple[int, ...], starter: int) -> int:
    """The setup of :func:`run`: process group, signals, pipes, cwd, storage, environment.
    Returns the events fd."""
    os.setpgid(0, 0)
    unix.set_name(f"taas-{spec.key}")
    signal.set_wakeup_fd(-1)
    for fd in private:  # the kernel's channel is the starter's alone
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A start process started from a thread that blocks SIGINT (a Ray actor's thread: the
    # cluster's node agents) hands the blocked mask down through fork and exec: a kept rank
    # must take the kernel's interrupt (SIGINT: KeyboardInterrupt in the cell's code).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    out, err, events = fds[: len(protocol.STREAMS)]
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(cwd)
    warning, storage = apply_storage(spec, cwd)
    # After any namespace change (which resets it): die with the starter.
    unix.prctl(unix.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != starter:  # it died before we asked
        os._exit(EX_SOFTWARE)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stdin = open(os.devnull)
    os.environ.update(spec.env)
    os.environ["TAAS_STORAGE"] = storage
    if warning:
        os.environ["TAAS_STORAGE_WARNING"] = warning
    return events
