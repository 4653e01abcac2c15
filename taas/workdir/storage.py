"""The storage rule in a rank > 0: a private layer over the working directory, or read-only.

Rank 0 writes checkpoints, logs and results under the working directory like any script.
The other ranks must never overwrite its files, nor each other's, silently (N ranks writing
the same file is the classic way to corrupt it).  Two ways, chosen by ``--storage``:

* ``layer`` (the default, :func:`mount_layer`): the rank sees the working directory through
  an overlay file system whose writable upper layer lies in the job directory
  (``<job_dir>/layer/<key>/upper``, :func:`layer_dir`).  Everything it writes lands there, so
  libraries that write from every rank (Hugging Face ``Trainer``'s ``rng_state_{rank}.pth``)
  just work; after the job the kernel merges each layer back (:mod:`taas.workdir.merge`) where it
  does not conflict with rank 0 or another rank.
* ``strict`` (DataSphere's rule, :func:`make_read_only`): the working directory is read-only;
  a write fails with EROFS.

Every rank, rank 0 included, has its own writable scratch directory (:func:`scratch_dir`).
Both are done in each freshly forked rank > 0 before anything else runs, while the process is
still single-threaded, in a mount namespace of the rank's own.

How the read-only rule is enforced (Linux, :func:`make_read_only`):

1. The process gets a mount namespace of its own: ``unshare(CLONE_NEWNS)`` when it is root,
   else ``unshare(CLONE_NEWUSER | CLONE_NEWNS)`` followed by identity maps of its own uid and
   gid (``/proc/self/uid_map`` = ``"<uid> <uid> 1"``, ``setgroups`` = ``deny``), so it keeps
   its uid/gid and gains the capabilities needed to mount inside that namespace only.  (Root
   without CAP_SYS_ADMIN, as in a default container, tries the user-namespace route too.)
2. Every mount of the new namespace is made private (``mount --make-rprivate /``) *before*
   anything is mounted.  A new mount namespace starts as a copy whose mounts keep their
   propagation: where ``/`` is shared (systemd makes it so on most hosts), a bind mount made
   in the copy would propagate back to the host namespace and make the directory read-only
   for the user's kernel, rank 0 and everyone else, and outlive the job.  (Namespaces made
   from a user namespace already turn shared mounts into slaves; root's do not.)
3. The directory is bind-mounted onto itself and that bind mount is remounted read-only,
   carrying over the flags the underlying mount already has (nosuid, nodev, noexec, atime
   mode...): in a user namespace those flags are locked, and a remount that drops one of them
   fails with EPERM.  Writes then fail with EROFS, root or not.
4. Each ``keep_writable`` path inside the directory (the job directory with the scratch
   directories, for example) is bind-mounted onto itself again and remounted read-write.
5. The process's current directory is re-entered (a bind mount over the directory it is in
   does not change the directory it already holds), and the result is checked: a file must
   not be creatable in the directory.

Everything happens in the rank's own namespace and its children inherit it; nothing changes
for any other process, and nothing needs cleaning up: the namespace ends with its last
process.  Mounts nested inside the directory (another file system mounted below it) keep
their own mode.

Where the kernel refuses (no user namespaces, seccomp, AppArmor's unprivileged-userns
restriction, no CAP_SYS_ADMIN, not Linux), :func:`make_read_only` undoes what it did and
returns a one-line reason; the caller prints it as a warning and the rule is then a
convention only.  Landlock is deliberately not used as a fallback: its rules are an
allow-list, so it cannot deny one subtree (the working directory) of a tree it must allow
(``/``, ``/tmp``, the job directory beneath the working directory...) without enumerating
every other writable place on the machine.

How the layer is mounted (:func:`mount_layer`): steps 1 and 2 as above, then the mount
points strictly inside the directory are opened (``O_PATH``) and an ``overlay`` file system is
mounted over the directory (``lowerdir`` = the directory itself, ``upperdir``/``workdir`` in
the job directory, the directory's nosuid/nodev/noexec flags carried over); the overlay does
not show mounts of the lower directory, so each of them is bind-mounted back at its place from
its open descriptor.  The current directory is re-entered and the result checked: a test file
created in the directory must appear in the upper layer.  The upper layer must not lie inside
the directory (the kernel refuses overlapping layers): with the job directory inside the
working directory, the layer is refused with a reason.  On any refusal the caller falls back
to :func:`make_read_only` and warns.

Side effects a user may notice in a rank that went the user-namespace route: files owned by
a uid or gid other than the rank's own show as owned by ``nobody`` (65534), and root-owned
files cannot be chowned; permission checks themselves are unchanged.  In a layer, a file owned
by another user cannot be changed there (copying it up would need that owner: EOVERFLOW).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import tempfile
from collections.abc import Sequence

__all__ = ["layer_dir", "make_read_only", "mount_layer", "scratch_dir"]

# The constants are re-exported: the rule is written with them.
from taas.workdir import namespaces as ns
from taas.workdir.namespaces import (  # noqa: F401 (tests use storage.CLONE_* and MS_*)
    CLONE_NEWNS, CLONE_NEWUSER, MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC,
    MS_REMOUNT, MS_NOSYMFOLLOW, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME, MNT_DETACH,
)

_REASON = "cannot make the working directory read-only for ranks > 0 ({})"
_LAYER_REASON = "cannot give ranks > 0 a private layer over the working directory ({})"

log = logging.getLogger(__name__)


def _inside(child: str, parent: str) -> bool:
    return child != parent and child.startswith(parent.rstrip(os.sep) + os.sep)


def _verify(path: str, keep: Sequence[str] = ()) -> str | None:
    """None if no file can be created in ``path`` (and in ``.`` when that is inside it and
    not inside a kept path)."""
    if not os.statvfs(path).f_flag & ns.ST_RDONLY:
        return f"{path} is still on a writable mount"
    cwd = os.getcwd()
    # "." is the directory this process holds, which need not be the one its name resolves to.
    held = (cwd == path or _inside(cwd, path)) and not any(
        cwd == k or _inside(cwd, k) for k in keep)
    if held and not os.statvfs(".").f_flag & ns.ST_RDONLY:
        return "the current directory is still on a writable mount"
    try:
        fd, name = tempfile.mkstemp(dir=path, prefix=".taas-ro-check-")
    except OSError:
        return None
    os.close(fd)
    os.unlink(name)
    return "a test file could still be created"


def make_read_only(path: str, keep_writable: Sequence[str] = ()) -> str | None:
    """Make ``path`` (a directory, normally ``os.getcwd()``) read-only for THIS process and
    its future children.

    Returns None when enforced, else a one-line reason why it could not be (the caller
    warns); in that case nothing is left half done: ``path`` stays writable.  Never raises.

    ``keep_writable``: paths that stay writable; only those that exist and lie strictly
    inside ``path`` (after ``realpath``) need and get a mount, the others are writable anyway.

    Must be called while the process is single-threaded (a kernel rule for entering a user
    namespace), i.e. right after fork.  It changes only this process's own namespaces. No
    Landlock fallback: see the module docstring.
    """
    if ns.libc is None:
        return _REASON.format(f"not supported on {sys.platform}")
    cwd = None
    mounted = False
    try:
        cwd = os.getcwd()
        path = os.path.realpath(path)
        if not os.path.isdir(path):
            return _REASON.format(f"{path}: not a directory")
        keep = sorted({k for k in (os.path.realpath(p) for p in keep_writable if p)
                       if _inside(k, path) and os.path.exists(k)}, key=len)
        # Flags before anything changes: a kept path was read-only already stays so.
        path_flags = ns.carried_flags(path)
        keep_flags = [(k, ns.carried_flags(k)) for k in keep]

        ns.enter_mount_namespace()
        ns.mount(None, "/", MS_REC | MS_PRIVATE, "mount --make-rprivate /")
        ns.mount(path, path, MS_BIND | MS_REC, "bind mount")
        mounted = True
        ns.mount(None, path, MS_REMOUNT | MS_BIND | MS_RDONLY | path_flags, "read-only remount")
        for k, flags in keep_flags:
            ns.mount(k, k, MS_BIND | MS_REC, f"bind mount of {k}")
            ns.mount(None, k, MS_REMOUNT | MS_BIND | flags, f"read-write remount of {k}")
        # The current directory still refers to the mount it was entered through.
        os.chdir(cwd)
        failure = _verify(path, keep)
        if failure is None:
            log.debug("storage strict: %s is read-only here; writable inside it: %s", path,
                      ", ".join(keep) or "nothing")
            return None
        reason = f"enforcement failed silently: {failure}"
    except ns.Refused as exc:
        reason = str(exc)
    except Exception as exc:  # the contract is a reason, never an exception
        reason = f"{type(exc).__name__}: {exc}"
    # undo: a reason means the directory is writable as before
    reason = _undo([path] if mounted else [], cwd, reason)
    log.debug("storage strict not enforced: %s", reason)
    return _REASON.format(" ".join(reason.split()))  # one line, whatever a path holds


def _submounts(path: str) -> list[str]:
    """Mount points strictly inside ``path`` in this namespace, outermost only (a bind mount
    with ``MS_REC`` brings the ones below along)."""
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
                  for line in f]
    inside = sorted({p for p in points if _inside(p, path)}, key=len)
    top: list[str] = []
    for p in inside:
        if not any(p == t or _inside(p, t) for t in top):
            top.append(p)
    return top


def _overlay_escape(path: str) -> str:
    """A path as overlayfs's option parser reads it (``:`` and ``,`` separate; ``\\`` escapes)."""
    return path.replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def _mount_overlay(path: str, upper: str, work: str, flags: int) -> None:
    options = (f"lowerdir={_overlay_escape(path)},upperdir={_overlay_escape(upper)},"
               f"workdir={_overlay_escape(work)}")
    # In a user namespace overlayfs cannot write its trusted.* xattrs (opaque directories,
    # redirects): it is told to use user.* ones, where the kernel knows that option (5.11+).
    tries = ["userxattr", ""] if ns.user_namespace else ["", "userxattr"]
    err = 0
    for extra in tries:
        data = os.fsencode(options + ("," + extra if extra else ""))
        if ns.libc.mount(b"overlay", os.fsencode(path), b"overlay", flags, data) == 0:
            log.debug("overlay over %s, upper layer %s%s", path, upper, f" ({extra})" if extra else "")
            return
        err = err or ctypes.get_errno()
    raise ns.Refused(f"overlay mount: {os.strerror(err) if err else 'failed'}", err)


def layer_dir(job_dir: str, key: str) -> str:
    """``<job_dir>/layer/<key>``: the directory holding a process's ``upper`` and ``work``
    directories (``key`` made a plain file name: ``loader:train:0`` -> ``loader-train-0``)."""
    return os.path.join(job_dir, "layer", re.sub(r"[^A-Za-z0-9_.-]", "-", key))


def mount_layer(path: str, layer: str) -> str | None:
    """Give THIS process (and its future children) a private writable layer over ``path``:
    what it writes under ``path`` lands in ``<layer>/upper``; the real directory and every
    other process are untouched.  See the module docstring for how.

    Returns None when done, else a one-line reason (nothing is left half done: ``path`` is as
    before, writable).  Never raises.  Must be called while the process is single-threaded.
    ``layer`` lies outside ``path`` (the job directory) and is created here.
    """
    if ns.libc is None:
        return _LAYER_REASON.format(f"not supported on {sys.platform}")
    cwd = None
    mounted: list[str] = []
    fds: list[int] = []
    try:
        cwd = os.getcwd()
        path = os.path.realpath(path)
        if not os.path.isdir(path):
            return _LAYER_REASON.format(f"{path}: not a directory")
        real_layer = os.path.realpath(layer)
        if real_layer == path or _inside(real_layer, path):
            return _LAYER_REASON.format("the job directory is inside the working directory")
        upper, work = os.path.join(real_layer, "upper"), os.path.join(real_layer, "work")
        os.makedirs(upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        flags = ns.carried_flags(path) & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME
                                        | MS_NODIRATIME | MS_RELATIME | MS_NOSYMFOLLOW)

        ns.enter_mount_namespace()
        ns.mount(None, "/", MS_REC | MS_PRIVATE, "mount --make-rprivate /")
        subs = _submounts(path)
        fds = [os.open(p, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW) for p in subs]
        _mount_overlay(path, upper, work, flags)
        mounted.append(path)
        for p, fd in zip(subs, fds):  # the overlay hides mounts below the lower directory
            ns.mount(f"/proc/self/fd/{fd}", p, MS_BIND | MS_REC, f"bind mount of {p}")
            mounted.append(p)
        os.chdir(cwd)  # the current directory still refers to the directory below
        fd, name = tempfile.mkstemp(dir=path, prefix=".taas-layer-check-")
        os.close(fd)
        landed = os.path.exists(os.path.join(upper, os.path.basename(name)))
        os.unlink(name)
        if landed:
            log.debug("storage layer: writes under %s land in %s", path, upper)
            return None
        reason = "enforcement failed silently: a test file did not land in the layer"
    except ns.Refused as exc:
        reason = str(exc)
    except Exception as exc:  # the contract is a reason, never an exception
        reason = f"{type(exc).__name__}: {exc}"
    finally:
        for fd in fds:
            os.close(fd)
    reason = _undo(reversed(mounted), cwd, reason)  # undo: a reason means the directory is as before
    log.debug("storage layer not mounted: %s", reason)
    return _LAYER_REASON.format(" ".join(reason.split()))


def _undo(mounts, cwd: str | None, reason: str) -> str:
    """Detach ``mounts`` (in that order) and re-enter ``cwd``; ``reason``, with any unmount
    that failed added to it."""
    for p in mounts:
        if ns.libc.umount2(os.fsencode(p), MNT_DETACH) != 0:
            reason += f"; undo failed: {os.strerror(ctypes.get_errno())}"
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError:
            pass
    return reason


def scratch_dir(job_dir: str, rank: int) -> str:
    """Create (if needed) and return ``<job_dir>/scratch/rank<rank>``, the rank's own
    writable directory."""
    path = os.path.join(job_dir, "scratch", f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path
