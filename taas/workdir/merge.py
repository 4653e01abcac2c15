"""After a ``--storage layer`` job: merge what ranks > 0 wrote back into the working directory.

Each rank > 0 wrote into the upper layer of an overlay over the working directory
(:func:`taas.workdir.storage.mount_layer`); rank 0 wrote the directory itself.  Once every
process has exited, :func:`merge_layers` walks each layer (plain directories, no mounts
needed) and decides, path by path:

* the same content as the working directory has now -> nothing to do;
* written by one rank > 0 (or by several, with identical content), and the working directory's
  file was not written during the job (absent, or older than ``since_ns``) -> moved into the
  working directory;
* otherwise a *conflict*: rank 0 also wrote it (its ctime is ``since_ns`` or later), or ranks
  > 0 wrote different contents, or a directory and a file meet at one path.  The working
  directory keeps what it has (rank 0's file, or the one from before the job); every
  differing copy goes to ``<conflict_dir>/<layer name>/<path>``.
* an overlay *whiteout* (a character device 0:0: the rank deleted the path) is not applied:
  ranks > 0 never delete the notebook's files.  It is listed in the report.

Files under a ``__pycache__`` directory are caches, never conflicts: applied when missing,
dropped otherwise.  Sockets, FIFOs and devices are not merged (listed as skipped).

"Written during the job" is judged by the file's ctime, which no process can set back, against
``since_ns``: the ctime of a file the kernel created in the working directory just before the
job (the same file system's clock).  Errs towards a conflict, never towards overwriting.
"""

from __future__ import annotations

import filecmp
import logging
import os
import shutil
import stat
from dataclasses import dataclass, field

from taas.io import keys

__all__ = ["MergeReport", "merge_layers", "clock_mark"]

_SHOWN = 4  # paths named in a note before "and N more"

log = logging.getLogger(__name__)


@dataclass
class MergeReport:
    applied: list[str] = field(default_factory=list)  # paths moved into the working directory
    conflicts: dict[str, list[str]] = field(default_factory=dict)  # path -> layers set aside
    deleted: dict[str, list[str]] = field(default_factory=dict)  # path -> layers that deleted it
    skipped: list[str] = field(default_factory=list)  # special files, not merged
    conflict_dir: str = ""  # as the notes show it (relative to the working directory)
    written: dict[str, list[str]] = field(default_factory=dict)  # path -> layers that wrote it

    def notes(self) -> list[str]:
        """One line per kind of event worth telling the user (none when all merged cleanly)."""
        notes = []
        if self.conflicts:
            who = sorted({name for names in self.conflicts.values() for name in names}, key=keys.order)
            notes.append(
                f"taas: {_names(who)} wrote {_paths(self.conflicts)} differently from rank 0 or "
                f"each other: the working directory keeps rank 0's version (or the one from "
                f"before the job); the other copies are in {self.conflict_dir}/ (for ranks that "
                f"share files on purpose: --storage shared)")
        if self.deleted:
            who = sorted({name for names in self.deleted.values() for name in names}, key=keys.order)
            notes.append(f"taas: {_names(who)} deleted {_paths(self.deleted)}: deletions by ranks "
                         "other than 0 are not applied to the working directory")
        if self.skipped:
            notes.append(f"taas: not merged back (not a regular file, link or directory): "
                         f"{_paths(self.skipped)}")
        return notes


def clock_mark(directory: str) -> int | None:
    """The ctime (ns) a file created in ``directory`` now gets, by that file system's clock;
    the file is removed at once.  None if ``directory`` is not writable."""
    import tempfile

    from taas.shield import deferred_interrupt

    with deferred_interrupt():  # made and removed as one step: a Ctrl-C never leaves it in the notebook's folder
        try:
            fd, name = tempfile.mkstemp(dir=directory, prefix=".taas-clock-")
        except OSError:
            return None
        try:
            return os.fstat(fd).st_ctime_ns
        finally:
            os.close(fd)
            os.unlink(name)


def merge_layers(target: str, layers: list[tuple[str, str]], since_ns: int,
                 conflict_dir: str) -> MergeReport:
    """Merge each ``(name, upper_dir)`` of ``layers`` (in order: rank1, rank2, ...) into
    ``target``; copies that conflict go under ``conflict_dir/<name>/``.  Files are moved out of
    the layers (they are removed afterwards anyway).  Errors on single paths are conflicts,
    never exceptions: a merge must not lose the job's result."""
    report = MergeReport(conflict_dir=os.path.relpath(conflict_dir, target)
                         if _inside(conflict_dir, target) else conflict_dir)
    entries: dict[str, list[tuple[str, str, str]]] = {}  # rel -> [(layer, path, kind)]
    dirs: dict[str, list[str]] = {}  # rel -> layers that have a directory there
    for name, upper in layers:
        for rel, path, kind in _walk(upper):
            if kind == "dir":
                dirs.setdefault(rel, []).append(name)
            else:
                entries.setdefault(rel, []).append((name, path, kind))
    for rel in sorted(entries):
        versions = entries[rel]
        for name, _, kind in versions:
            if kind == "whiteout":
                report.deleted.setdefault(rel, []).append(name)
            elif kind == "other":
                if rel not in report.skipped:
                    report.skipped.append(rel)
        versions = [v for v in versions if v[2] in ("file", "link")]
        if versions:
            report.written[rel] = [name for name, _, _ in versions]
            _merge_path(target, rel, versions, since_ns, conflict_dir, report)
    for rel in sorted(dirs, key=len):  # directories a rank made, empty ones included
        real = os.path.join(target, rel)
        if not os.path.lexists(real) and _parents_ok(target, rel):
            try:
                os.makedirs(real)
            except OSError:
                pass
    log.debug("merged %s into %s: applied %s; conflicts %s; deletions not applied %s; skipped %s",
              ", ".join(name for name, _ in layers) or "no layer", target, report.applied or "none",
              report.conflicts or "none", report.deleted or "none", report.skipped or "none")
    return report


def _merge_path(target: str, rel: str, versions: list, since_ns: int, conflict_dir: str,
                report: MergeReport) -> None:
    real = os.path.join(target, rel)
    real_st: os.stat_result | None = None
    unreachable = False  # a parent is a file, or unreadable: cannot be merged in place
    try:
        real_st = os.lstat(real)
    except FileNotFoundError:
        pass
    except OSError:
        unreachable = True
    distinct = [versions[0]]  # one per content the ranks > 0 wrote
    for v in versions[1:]:
        if not any(_same_pair(v, d) for d in distinct):
            distinct.append(v)
    if real_st:
        differ = [v for v in versions if not _same(v[1], v[2], real, real_st)]
        if not differ:
            return  # what the working directory has: nothing to do
        touched = real_st.st_ctime_ns >= since_ns  # rank 0 (or someone) wrote it meanwhile
        clash = touched or stat.S_ISDIR(real_st.st_mode)
    else:
        differ = versions
        clash = unreachable or not _parents_ok(target, rel)
    if "__pycache__" in rel.split(os.sep):  # a cache: never worth a conflict
        if real_st is None and not unreachable and not clash:
            try:
                _place(distinct[0][1], real)
                report.applied.append(rel)
            except OSError:
                pass
        return
    if not clash and len(distinct) == 1:
        try:
            _place(distinct[0][1], real)
            report.applied.append(rel)
            return
        except OSError:
            pass  # set it aside below
    for name, path, _ in differ:
        try:
            _place(path, os.path.join(conflict_dir, name, rel))
        except OSError:
            continue
        report.conflicts.setdefault(rel, []).append(name)


def _walk(upper: str):
    """(relative path, full path, kind) for everything in an upper layer; kind is ``dir``,
    ``file``, ``link``, ``whiteout`` or ``other``."""
    for root, subdirs, files in os.walk(upper):
        for name in subdirs + files:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            rel = os.path.relpath(path, upper)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                kind = "dir"
            elif stat.S_ISREG(mode):
                kind = "file"
            elif stat.S_ISLNK(mode):
                kind = "link"
            elif stat.S_ISCHR(mode) and st.st_rdev == 0:
                kind = "whiteout"
            else:
                kind = "other"
            yield rel, path, kind
        subdirs[:] = [d for d in subdirs if not os.path.islink(os.path.join(root, d))]


def _same(path: str, kind: str, real: str, real_st: os.stat_result) -> bool:
    if kind == "link":
        return stat.S_ISLNK(real_st.st_mode) and os.readlink(path) == os.readlink(real)
    if not stat.S_ISREG(real_st.st_mode):
        return False
    try:
        return filecmp.cmp(path, real, shallow=False)
    except OSError:
        return False


def _same_pair(a: tuple, b: tuple) -> bool:
    if a[2] != b[2]:
        return False
    return _same(a[1], a[2], b[1], os.lstat(b[1]))


def _parents_ok(target: str, rel: str) -> bool:
    """Every parent of ``rel`` under ``target`` is a directory or missing (can be made)."""
    parent = os.path.dirname(rel)
    while parent:
        p = os.path.join(target, parent)
        if os.path.lexists(p) and (os.path.islink(p) or not os.path.isdir(p)):
            return False
        parent = os.path.dirname(parent)
    return True


def _place(src: str, dst: str) -> None:
    """Move ``src`` to ``dst`` atomically (a rename, or a copy next to ``dst`` then a rename),
    creating ``dst``'s parents."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.replace(src, dst)
        return
    except OSError as exc:
        if exc.errno != 18:  # EXDEV: another file system
            raise
    tmp = os.path.join(os.path.dirname(dst), f".taas-merge-{os.getpid()}-{os.path.basename(dst)}")
    try:
        if os.path.islink(src):
            os.symlink(os.readlink(src), tmp)
        else:
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:  # Ctrl-C included: never leave the temporary file; re-raised
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _inside(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip(os.sep) + os.sep)


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _paths(paths) -> str:
    paths = sorted(paths)
    shown = ", ".join(paths[:_SHOWN])
    return shown + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")


# Directories whose files are no news to a user: taas's own, caches, Jupyter's, git's.
_NOT_NEWS = frozenset({".taas", "__pycache__", ".ipynb_checkpoints", ".git"})


class Layers:
    """The ``--storage layer`` bookkeeping of one attempt: the working directory's clock before
    the launch, and the merge of every process's layer once all of them have exited."""

    def __init__(self, cwd: str, active: bool):
        self.cwd = cwd
        self.active = active  # a lone rank 0 has no layer
        self.since_ns = 0
        self.done = False

    def mark(self) -> None:
        if self.active:
            self.since_ns = clock_mark(self.cwd) or 0  # 0: every existing file counts as touched

    def written(self, limit: int = 5000) -> list[str]:
        """Files of the working directory itself written since :meth:`mark` (by rank 0, the
        notebook, anyone: not the layers), as sorted relative paths; call it before
        :meth:`merge`.  At most ``limit`` entries are looked at (a dataset directory is not
        walked through); taas's own, caches and notebooks (saved while a job runs) are left out."""
        if not self.active or not self.since_ns:
            return []
        found: list[str] = []
        pending, seen = [self.cwd], 0
        while pending and seen < limit:
            try:
                with os.scandir(pending.pop()) as entries:
                    for entry in entries:
                        seen += 1
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name not in _NOT_NEWS:
                                pending.append(entry.path)
                        elif not entry.name.endswith(".ipynb") and (
                                entry.stat(follow_symlinks=False).st_ctime_ns >= self.since_ns):
                            found.append(os.path.relpath(entry.path, self.cwd))
            except OSError:  # gone or unreadable meanwhile: nothing to say about it
                continue
        return sorted(found)

    def merge(self, layers: list[tuple[str, str]], job_id: str, sink) -> MergeReport | None:
        """Merge ``layers`` (``(name, upper)``, JobHandle.layers) into the working directory
        (once), showing the notes; the report (None: nothing merged); never raises but for Ctrl-C."""
        if not self.active or self.done:
            return None
        self.done = True
        layers = sorted(layers, key=lambda item: keys.order(item[0]))
        conflicts = os.path.join(self.cwd, ".taas", "conflicts", job_id)
        try:
            result = merge_layers(self.cwd, layers, self.since_ns, conflicts)
        except Exception as exc:  # never lose the job's result over it
            sink.write("stderr", f"taas: could not merge the ranks' layers back: {exc}\n")
            return None
        for line in result.notes():
            sink.write("stderr", line + "\n")
        return result
