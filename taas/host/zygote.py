"""``python -m taas.host.zygote``: a kernel's warm process that forks job hosts in milliseconds.

A job host started as a fresh interpreter is warm only after two ``import torch`` (its own, and
its start process's): seconds of CPU on a small machine, paid again for every detached cell,
since each detached job keeps its host.  So a kernel starts this process once (``spares.py``),
ahead of need: it imports what a host and a start process import, without initialising CUDA,
and stays single-threaded.  For each :class:`~taas.host.api.Fork` it forks a job host, which
forks its start process in turn (:mod:`taas.launch.local.forkstart`), with everything already
imported::

    kernel ──Fork(env) + [host socket, log]──> zygote ──fork, fork──> job host (its own session;
                                                        not our child)   └──fork──> guard ──> start process

The host is a grandchild that the middle child leaves at once, so it is nobody's child here and
outlives us as a host started by ``subprocess`` outlives its kernel.  The zygote ends when the
kernel's end of its socket closes (the kernel's exit, restart or death, ``%unload_ext``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
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
    middle = os.fork()
    if middle:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(middle, 0)
        return
    try:  # the middle child, then the host: never back into the loop above
        os.setsid()  # a session of its own: no terminal, no signal meant for the kernel's group
        if os.fork():
            os._exit(0)
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
