"""Linux namespaces and mounts for the storage rule (:mod:`taas.workdir.storage`): libc's
``unshare``, ``mount`` and ``prctl`` through ctypes, and entering a mount namespace of the
process's own (as root, or through a user namespace that keeps its uid and gid).  A refused
step raises :class:`Refused` with the step and the error; nothing here decides a policy.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys

# <sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000

# <sys/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

# statvfs().f_flag (<sys/statvfs.h>, the kernel's ST_*) -> the mount flag that keeps it.
# Superblock-only flags (synchronous, mandlock) are not per-mount and need no carrying.
CARRIED_FLAGS = (
    (0x0001, MS_RDONLY),  # ST_RDONLY
    (0x0002, MS_NOSUID),  # ST_NOSUID
    (0x0004, MS_NODEV),  # ST_NODEV
    (0x0008, MS_NOEXEC),  # ST_NOEXEC
    (0x0400, MS_NOATIME),  # ST_NOATIME
    (0x0800, MS_NODIRATIME),  # ST_NODIRATIME
    (0x1000, MS_RELATIME),  # ST_RELATIME
    (0x2000, MS_NOSYMFOLLOW),  # ST_NOSYMFOLLOW
)
ST_RDONLY = 0x0001

# <linux/prctl.h>
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4



class Refused(Exception):
    """One step failed; ``str()`` is the step and the error, e.g. ``unshare: Operation not permitted``."""

    def __init__(self, message: str, err: int = 0):
        super().__init__(message)
        self.errno = err


def load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.unshare.argtypes = [ctypes.c_int]
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_void_p]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong,
                               ctypes.c_ulong, ctypes.c_ulong]
        return libc
    except (OSError, AttributeError):
        return None


libc = load_libc()


def check(step: str, rc: int) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise Refused(f"{step}: {os.strerror(err) if err else 'failed'}", err)


def unshare(flags: int, step: str = "unshare") -> None:
    check(step, libc.unshare(flags))


def mount(source: str | None, target: str, flags: int, step: str) -> None:
    src = os.fsencode(source) if source is not None else None
    check(step, libc.mount(src, os.fsencode(target), None, flags, None))


def carried_flags(path: str) -> int:
    """The per-mount flags ``path``'s mount has now, as ``mount(2)`` flags."""
    have = os.statvfs(path).f_flag
    flags = 0
    for st, ms in CARRIED_FLAGS:
        if have & st:
            flags |= ms
    return flags


def write_proc(name: str, text: str) -> None:
    fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
    try:
        os.write(fd, text.encode())  # one write(2): the kernel takes a map in one go
    finally:
        os.close(fd)


log = logging.getLogger("taas.workdir.storage")

user_namespace = False  # this process entered a user namespace of its own


def enter_user_namespace() -> None:
    """``unshare(CLONE_NEWUSER | CLONE_NEWNS)``, keeping this process's own uid and gid."""
    global user_namespace
    uid, gid = os.geteuid(), os.getegid()
    try:
        unshare(CLONE_NEWUSER | CLONE_NEWNS)
        user_namespace = True
        log.debug("entered a user namespace of its own (uid %d, gid %d)", uid, gid)
    except Refused as exc:
        hint = {errno.ENOSPC: "user namespaces disabled or exhausted: sysctl user.max_user_namespaces",
                errno.EINVAL: "the process has threads"}.get(exc.errno)
        if hint:
            raise Refused(f"{exc}; {hint}", exc.errno) from None
        raise
    # /proc/self/*_map belong to root while the process is not dumpable (after a setuid, for
    # example), and only the process itself may write a map of its own id: be dumpable for
    # the two writes.
    dumpable = libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)
    if dumpable != 1:
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            try:
                write_proc(name, text)
            except FileNotFoundError:
                if name != "setgroups":  # kernels before 3.19 have no setgroups file
                    raise Refused(f"{name}: no such file") from None
            except OSError as exc:
                raise Refused(f"{name}: {exc.strerror}") from None
    finally:
        if dumpable != 1:
            libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def enter_mount_namespace() -> None:
    if os.geteuid() == 0:
        try:
            unshare(CLONE_NEWNS)
            return
        except Refused as first:
            if first.errno != errno.EPERM:  # root without CAP_SYS_ADMIN: try userns
                raise
            try:
                enter_user_namespace()
                return
            except Refused as second:
                raise Refused(f"unshare: Operation not permitted; user namespace: {second}") from None
    enter_user_namespace()
