"""``python -m taas.host.zygote``: a kernel's warm process that forks job hosts in milliseconds.

A job host started as a fresh interpreter is warm only after two ``import torch`` (its own, and
its start process's): seconds of CPU on a small machine, paid again for every detached cell,
since each detached job keeps its host.  So a kernel starts this process once (``spares.py``),
ahead of need: it imports what a host and a start process import, without initialising CUDA,
and stays single-threaded.  For each :class:`~taas.host.api.Fork` it forks a job host, which
forks its start process in turn (:mod:`taas.launch.local.forkstart`), with everything already
imported::

    kernel ──Fork(env) + [host socket, log]──> zygote ──fork──> job host (its own session)
                                                                   └──fork──> guard ──> start process

The host is the zygote's child, in a session of its own; the zygote ignores SIGCHLD, so the
system reaps a host that ends while the zygote lives, and a host that outlives the zygote is
re-parented as any orphan (one fork, not the classic two: each fork and exit of a process that
holds torch costs tens of milliseconds of page tables here).  The zygote ends when the
kernel's end of its socket closes (the kernel's exit, restart or death, ``%unload_ext``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import traceback

from taas.host.api import Fork, decode

log = logging.getLogger(__name__)


def main() -> int:
    channel = socket.socket(fileno=int(os.environ.pop("TAAS_ZYGOTE_SOCKET")))
    own_log = os.environ.pop("TAAS_ZYGOTE_LOG", "")
    try:
        return _serve(channel)
    finally:
        with contextlib.suppress(OSError):  # our stderr: kept only if taas itself said something
            if own_log and os.stat(own_log).st_size == 0:
                os.unlink(own_log)


def _serve(channel: socket.socket) -> int:
    from taas.host import main as host
    from taas.session import Session

    Session.preload_for_fork()  # torch and the rank runtime, as a start process has them
    # The hosts we fork are ours to reap, but we never wait for them: ignoring SIGCHLD has the
    # system reap each one as it ends, so none lingers as a zombie while we live.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.freeze()  # what every host and start process shares: never walked (and copied) by their GC
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, 1 << 20, 2)
        except OSError:
            return 0
        if not data:
            return 0  # the kernel is gone, or closed us
        message = decode(data)
        if not isinstance(message, Fork) or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        _fork_host(message, fds[0], fds[1], channel, host.main)
        for fd in fds:
            os.close(fd)


def _fork_host(message: Fork, host_fd: int, log_fd: int, channel: socket.socket, host_main) -> None:
    if os.fork():
        return  # reaped by the system when it ends (SIGCHLD ignored, _serve)
    try:  # the host: never back into the loop above
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own children it waits for
        os.setsid()  # a session of its own: no terminal, no signal meant for the kernel's group
        channel.close()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(message.env)
        os.environ["TAAS_HOST_SOCKET"] = str(host_fd)
        os.environ["TAAS_FORK_START"] = "1"  # its start process: forked from it, warm
        if message.ready:
            os.environ["TAAS_READY_HINT"] = str(message.ready)
        code = host_main()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
