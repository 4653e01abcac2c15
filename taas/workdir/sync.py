"""The notebook's working directory on cluster nodes that do not share the kernel's filesystem.

Why: on one machine (and on a cluster whose nodes mount the same project storage) every process
of a job starts in the notebook's working directory, reads the data files the notebook made, and
rank 0's checkpoint is there for the next cell.  A node that does not see that directory gets a
*copy* of it instead, kept per kernel on the node and updated before each job; after the job,
what the processes allowed to write it (rank 0, or every rank under ``--storage shared``)
changed there comes back into the notebook's working directory.  This module is the pure part
(what is copied, what changed, how big, applying a change set); the Ray launcher
(:mod:`taas.launch.ray.launcher`, :mod:`taas.launch.ray.job`) and each node's agent
(:mod:`taas.launch.ray.agent`) only call it.

The rules (docs/user-guide.md, "Clusters"):

* Copied: regular files, symbolic links (as links) and directories under the working
  directory, except directories named in :data:`SKIPPED_DIRS` anywhere in the tree (version
  control, caches, Jupyter's checkpoints, taas's own ``.taas``) and taas's own marker files
  (``.taas-*`` at the top).  Sockets, FIFOs and devices are never copied.
* The copy must not exceed a size limit (:data:`DEFAULT_LIMIT`, ``TAAS_WORKDIR_LIMIT``, or
  ``%taas cluster ADDRESS --workdir-limit SIZE``): larger data belongs on storage the nodes
  mount, or in a registered loader.
* A file is the same on both sides when its kind, size, mode and mtime (ns) are: the copy's
  mtimes are set to the notebook's, and files coming back get the node's, so a warm cell ships
  only what changed since the last one.
* Back into the working directory come new and changed files, links and directories; a file
  deleted on the node is deleted in the working directory only if it is still the one the job
  started with (never a file the notebook changed meanwhile).

An entry is ``(rel, kind, mode, mtime_ns, data)``: ``kind`` is ``"f"`` (``data``: the bytes),
``"l"`` (``data``: the link's target) or ``"d"`` (``data``: None).  A manifest maps ``rel`` to
``(kind, size, mode, mtime_ns)``.
"""

from __future__ import annotations

import os
import re
import stat

from taas.errors import LaunchError

SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".ipynb_checkpoints", ".taas"})
MARKER_PREFIX = ".taas-"  # the kernel's own short-lived files at the top (clock marks, markers)
DEFAULT_LIMIT = 1 << 30  # bytes
LIMIT_ENV = "TAAS_WORKDIR_LIMIT"
MODES = ("auto", "shared", "copy")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"500M"``, ``"2G"``, ``"1.5g"``, ``"4096"`` (bytes; K/M/G/T are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (like 500M, 2G, or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def limit_from_env() -> int:
    text = os.environ.get(LIMIT_ENV)
    if not text:
        return DEFAULT_LIMIT
    try:
        return parse_size(text)
    except ValueError as exc:
        raise LaunchError(f"{LIMIT_ENV}: {exc}") from None


def human(size: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def skipped(rel: str, is_dir: bool) -> bool:
    """Whether ``rel`` (relative, ``/``-separated) is left out of the copy."""
    parts = rel.split("/")
    if len(parts) == 1 and parts[0].startswith(MARKER_PREFIX):
        return True
    return any(p in SKIPPED_DIRS for p in (parts if is_dir else parts[:-1]))


def _entry(st: os.stat_result) -> tuple | None:
    """A manifest entry (kind, size, mode, mtime_ns) for a directory, regular file or link;
    None for anything else (sockets, FIFOs, devices are never copied)."""
    if stat.S_ISDIR(st.st_mode):
        return ("d", 0, stat.S_IMODE(st.st_mode), 0)
    if stat.S_ISREG(st.st_mode):
        return ("f", st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    if stat.S_ISLNK(st.st_mode):
        return ("l", st.st_size, 0, st.st_mtime_ns)
    return None


def scan(root: str, skip: bool = True) -> dict[str, tuple]:
    """The manifest of what is copied of ``root``: rel -> (kind, size, mode, mtime_ns); with
    ``skip=False``, of everything under it (a rank's layer)."""
    out: dict[str, tuple] = {}

    def walk(directory: str, prefix: str) -> None:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            return  # unreadable: not copied (a rank there would not read it either)
        for entry in entries:
            rel = prefix + entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if skip and skipped(rel, is_dir):
                continue
            found = _entry(st)
            if found is not None:
                out[rel] = found
            if is_dir:
                walk(entry.path, rel + "/")

    walk(root, "")
    return out


def size_of(manifest: dict[str, tuple]) -> int:
    return sum(size for kind, size, _, _ in manifest.values() if kind == "f")


def check_size(manifest: dict[str, tuple], limit: int, root: str) -> None:
    """A one-line LaunchError when the copy would exceed ``limit`` bytes."""
    total = size_of(manifest)
    if total > limit:
        raise LaunchError(
            f"the working directory {root} holds {human(total)} to copy to cluster nodes that do not "
            f"share it, over the limit of {human(limit)}: move large data to storage every node "
            f"mounts (or a registered loader), or raise the limit (%taas cluster ADDRESS "
            f"--workdir-limit SIZE, or {LIMIT_ENV})")


def diff(old: dict[str, tuple], new: dict[str, tuple]) -> tuple[list[str], list[str]]:
    """``(changed, deleted)``: paths of ``new`` that ``old`` lacks or holds differently (parents
    first), and paths of ``old`` that ``new`` lacks (children first)."""
    changed = sorted(rel for rel, entry in new.items() if old.get(rel) != entry)
    deleted = sorted((rel for rel in old if rel not in new), reverse=True)
    return changed, deleted


def pack(root: str, manifest: dict[str, tuple], rels: list[str]) -> list[tuple]:
    """The entries for ``rels`` (which ``manifest`` describes) as they are under ``root``; a
    path that vanished or changed kind meanwhile is left out (the next job ships it)."""
    out = []
    for rel in rels:
        kind, _, mode, mtime = manifest[rel]
        path = os.path.join(root, rel)
        try:
            if kind == "f":
                with open(path, "rb") as f:
                    data = f.read()
            elif kind == "l":
                data = os.readlink(path)
            else:
                data = None
        except OSError:
            continue
        out.append((rel, kind, mode, mtime, data))
    return out


def _safe(root: str, rel: str) -> str:
    """``root/rel``, refusing anything that would land outside ``root``."""
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
        raise ValueError(f"not a relative path inside the working directory: {rel!r}")
    return os.path.join(root, *rel.split("/"))


def apply(root: str, entries: list[tuple], deleted: list[str] = (),
          keep_if: dict[str, tuple] | None = None) -> list[str]:
    """Write ``entries`` under ``root`` (mtimes as given) and remove ``deleted`` paths; returns
    the paths that could not be written or removed.  With ``keep_if`` (the manifest the job
    started from), a path is removed only while ``root`` still holds exactly that entry."""
    failed = []
    dirs = []
    for rel, kind, mode, mtime, data in sorted(entries, key=lambda e: e[0]):
        try:
            path = _safe(root, rel)
            if kind == "d":
                if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
                    os.unlink(path)
                os.makedirs(path, exist_ok=True)
                dirs.append((path, mode))
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.isdir(path) and not os.path.islink(path):
                _remove_tree(path)
            if kind == "l":
                if os.path.lexists(path):
                    os.unlink(path)
                os.symlink(data, path)
                os.utime(path, ns=(mtime, mtime), follow_symlinks=False)
            else:
                tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.taas-part")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.chmod(tmp, mode)
                os.utime(tmp, ns=(mtime, mtime))
                os.replace(tmp, path)  # never a half-written file under the real name
        except (OSError, ValueError):
            failed.append(rel)
    for path, mode in dirs:
        try:
            os.chmod(path, mode | stat.S_IRWXU)  # we must be able to update it next time
        except OSError:
            pass
    for rel in deleted:
        try:
            path = _safe(root, rel)
            if keep_if is not None:
                now = scan_one(root, rel)
                if now is None:
                    continue
                if now != keep_if.get(rel) and now[0] != "d":
                    continue  # the notebook changed it meanwhile: keep its version
            if os.path.isdir(path) and not os.path.islink(path):
                if keep_if is not None:
                    os.rmdir(path)  # only an empty one: what it holds was judged path by path
                else:
                    _remove_tree(path)
            elif os.path.lexists(path):
                os.unlink(path)
        except (OSError, ValueError):
            if keep_if is None:
                failed.append(rel)
    return failed


def scan_one(root: str, rel: str) -> tuple | None:
    """``rel``'s manifest entry as ``root`` holds it now, or None."""
    try:
        st = os.lstat(_safe(root, rel))
    except (OSError, ValueError):
        return None
    return _entry(st) or ("other", 0, 0, 0)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def read_tree(root: str) -> list[tuple]:
    """Every regular file, link and directory under ``root`` as entries (a rank's layer, sent
    to the kernel).  Overlay whiteouts (a rank > 0 deleted a path) are not sent: such deletions
    are never applied to the working directory."""
    manifest = scan(root, skip=False)
    return pack(root, manifest, sorted(manifest))


# -- the node's clean-up -----------------------------------------------------------------------
COPY_PREFIX = "taas-workdir-"  # <tmp>/taas-workdir-<agent pid>-XXXX: one agent's copies
