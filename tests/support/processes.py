"""Processes, shared memory and ports a test watches, and waiting for events (not for time).

Only the standard library and psutil: the GPU suite (no jupyter_client there) uses these too.
"""

from __future__ import annotations

import os
import time

import psutil


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def listening_ports(pids: set[int]) -> set[int]:
    ports = set()
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            ports.add(conn.laddr.port)
    return ports


def wait_for(predicate, timeout: float = 300.0, what: str = "the condition", poll: float = 0.05):
    """Poll ``predicate`` until it returns something true (returned); an event, not a time:
    ``timeout`` is an upper bound that only a real failure reaches."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen in {timeout}s")
        time.sleep(poll)


def wait_until_gone(pids, timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while time.monotonic() < deadline:
        alive = [p for p in alive if is_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def is_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it has ended, unreaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def unmapped_shm(names: set, wait: float = 3.0) -> set:
    """The /dev/shm entries among ``names`` that no process maps: leaked.  (Other kernels on
    this machine may be running jobs too: their segments are mapped, not ours to judge.)"""
    deadline = time.monotonic() + wait
    while True:
        left = {n for n in names if os.path.exists(f"/dev/shm/{n}")}
        if left:
            mapped = set()
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        with open(f"/proc/{pid}/maps") as f:
                            text = f.read()
                    except OSError:
                        continue
                    mapped |= {n for n in left if f"/dev/shm/{n}" in text}
            left -= mapped
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def process_name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def open_files(p: psutil.Process) -> list:
    try:
        return p.open_files()
    except psutil.Error:
        return []


def own_fds() -> set[tuple[str, str]]:
    """This process's open fds, each with what it points at (to compare before and after)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own fd
            pass
    return out


def own_shm_maps(job_id: str) -> list[str]:
    """The lines of this process's memory map that map job ``job_id``'s /dev/shm segments."""
    with open("/proc/self/maps") as f:
        return [line for line in f if f"/dev/shm/taas-{job_id}-" in line]
