"""One attempt's copies of the notebook's working directory, on the nodes that do not see it.

A node that does not share the kernel's filesystem keeps a copy of the working directory (its
agent's, :meth:`NodeAgent.workdir_update`), brought up to date before the attempt starts
(:meth:`WorkdirCopies.ship`: the kernel scans the directory, each agent says what it lacks,
what several lack alike travels once through the object store).  Once the attempt's processes
are gone, what the writers there changed comes back (:meth:`WorkdirCopies.bring_back`, before
the layers are merged, so that rank 0's files count as written during the job), rank 0's node
last; and the ``--storage layer`` uppers of those nodes come back as files of the kernel's
(:meth:`WorkdirCopies.fetch_layers`), removed at :meth:`WorkdirCopies.remove`.
"""

from __future__ import annotations

import logging
import os

from taas.errors import LaunchError
from taas.launch.ray.cluster import CALL_TIMEOUT, message

log = logging.getLogger(__name__)


class WorkdirCopies:
    """The copies of ``cwd`` one attempt uses: node id -> the copy's path on that node."""

    def __init__(self, ray, cwd: str, attempt: str, limit: int | None):
        self._ray = ray
        self._cwd = cwd
        self._attempt = attempt
        self._limit = limit  # bytes; None: $TAAS_WORKDIR_LIMIT, else 1 GiB
        self.paths: dict[str, str] = {}  # node id -> its copy, where its processes start
        self._snapshot: dict[str, tuple] = {}  # the working directory's manifest they started from
        self._brought = False
        self._layer_root: str | None = None  # copy nodes' layers, fetched for the merge

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.paths

    def cwd_of(self, node_id: str) -> str:
        """Where ``node_id``'s processes start: its copy, or the working directory itself."""
        return self.paths.get(node_id, self._cwd)

    def ship(self, agents: dict[str, object], ips: dict[str, str]) -> None:
        """Bring each agent's copy (``agents``: node id -> the agent of a node that gets one) up
        to date; raises LaunchError naming each node that failed (``ips``: node id -> address)."""
        from taas.workdir import sync as workdir_sync

        cwd = self._cwd
        manifest = workdir_sync.scan(cwd)
        limit = workdir_sync.limit_from_env() if self._limit is None else self._limit
        workdir_sync.check_size(manifest, limit, cwd)
        needs = {n: agent.workdir_need.remote(cwd, manifest) for n, agent in agents.items()}
        packs: dict[tuple, object] = {}  # what a node lacks -> its entries, put once
        updates = {}
        for node_id, ref in needs.items():
            need = tuple(self._get(ref))
            if need not in packs:
                packs[need] = self._ray.put(workdir_sync.pack(cwd, manifest, list(need)))
            updates[node_id] = agents[node_id].workdir_update.remote(cwd, manifest, packs[need])
        errors = []
        for node_id, ref in updates.items():
            try:
                self.paths[node_id] = self._get(ref)
            except Exception as exc:  # broad: the agent's LaunchError or any Ray error, told as one line
                errors.append(f"node {ips[node_id]}: {message(exc)}")
        if errors:
            raise LaunchError("could not copy the working directory: " + "; ".join(errors))
        self._snapshot = manifest

    def bring_back(self, agents: dict[str, object], writers: set[str], rank0: str | None) -> None:
        """Once the attempt's processes are gone: what they changed in the copies, from the
        nodes whose processes may write the working directory (``writers``: rank 0's; every
        process's under ``--storage shared``), into the working directory; rank 0's node last
        (its version wins).  Every copy's agent rescans its copy, writers or not.  Once."""
        if self._brought or not self.paths:
            return
        self._brought = True
        from taas.workdir import sync as workdir_sync

        refs = {n: agents[n].workdir_changes.remote(self._cwd) for n in self.paths if n in agents}
        for node_id in sorted(refs, key=lambda n: n == rank0):
            try:
                entries, deleted = self._get(refs[node_id])
            except Exception as exc:  # broad: a lost node's files are lost with it
                log.warning("could not bring the working directory back from node %s: %s",
                            node_id, message(exc))
                continue
            if node_id in writers:
                failed = workdir_sync.apply(self._cwd, entries, deleted, keep_if=self._snapshot)
                if failed:
                    log.warning("could not write back into %s: %s", self._cwd, ", ".join(failed[:4]))

    def again(self) -> None:
        """Kept ranks (``--keep``): the next cell of the same processes brings back again."""
        self._brought = False

    def fetch_layers(self, found: dict[str, list]) -> list[tuple[str, str]]:
        """The copy nodes' layers (``found``: node id -> the agent's ``layer_entries()``) as
        directories of the kernel's: ``(name, path)``.  Never raises: the supervisor closes the
        job right after the merge; a layer that finds no room is left out, with a warning."""
        import tempfile

        from taas.launch.local import jobdir
        from taas.workdir import sync as workdir_sync

        out = []
        for node_id, layers in found.items():
            if node_id not in self.paths:
                continue
            for name, entries in layers:
                try:
                    if self._layer_root is None:
                        self._layer_root = tempfile.mkdtemp(prefix=f"taas-{self._attempt}-layers-")
                    upper = os.path.join(self._layer_root, name)
                    os.mkdir(upper)
                except OSError as exc:
                    log.warning("%s", jobdir.no_room(f"fetch {name}'s layer", exc))
                    continue
                workdir_sync.apply(upper, entries)
                out.append((name, upper))
        return out

    def remove(self) -> None:
        """Remove the layers fetched here (the nodes' copies stay, for the next attempt)."""
        if self._layer_root is not None:
            from taas.launch.local import jobdir

            jobdir.remove(self._layer_root)
            self._layer_root = None

    def _get(self, ref):
        return self._ray.get(ref, timeout=CALL_TIMEOUT)
