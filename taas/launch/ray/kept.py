"""Kept ranks (``--keep``) on a Ray cluster: the kept-ranks part of the launcher contract
(:mod:`taas.launch.api`: ``next_cell``, ``lost``, ``interrupt``, ``memory``, ``reserved``) for
:class:`~taas.launch.ray.job.RayJob`.

A kept job's ranks stay children of their nodes' warm start processes, under the node agents,
between cells: each agent's local job handle already implements the kept-ranks calls on its
node (:class:`~taas.launch.local.job.LocalJob`: the cell FIFOs, SIGINT to the ranks), so the
kernel's side only fans each call out to the agents of the job's nodes, all at once, and
gathers the answers:

    next_cell   the nodes' copies of the working directory brought up to date (where a node
                has one), the payload once into the object store, every agent's next_cell
    cell_done   what the cell wrote in those copies comes back to the working directory
    lost        exits already reported, agents found dead, then every agent's lost()
    interrupt   each agent signals its node's ranks
    memory      each agent measures its node's processes

The GPU reservation (the job's placement group) is held while the ranks live: it is given back
only once every rank exited or the job was stopped (``RayJob._let_go_when_ranks_ended``), so
between kept cells the GPUs stay the kept ranks' and ``%taas`` says where (:meth:`reserved`).
A killed kernel ends kept ranks as it ends a running job: each agent watches the kernel's Ray
driver (``NodeAgent._watch_kernel``) and Ray ends the agents with the kernel's connection.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from taas.errors import KeptRanksGone, LaunchError
from taas.launch.api import ProcessExit
from taas.launch.ray.cluster import CALL_TIMEOUT, message
from taas.launch.ray.copies import WorkdirCopies

_INTERRUPT_TIMEOUT = 5.0  # seconds an agent gets to signal its ranks (it only sends SIGINT)


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


class KeptCalls:
    """RayJob's kept-ranks calls; uses RayJob's agents (``_agents``), where each process runs
    (``_node_of``, ``_ip_of``), its event merge (``_wait``, ``_pending``, ``_lose``)."""

    # Set by RayJob; declared here for the type checker.
    _agents: dict
    _node_of: dict
    _ip_of: dict
    _lost: dict
    _ranks: set
    _exited: set
    _pending: list
    _polls: dict
    _pids: dict
    _stopped: bool
    _let_go: bool
    _reserving: bool
    _ray: Any  # the ray module
    closed: bool

    _copies: WorkdirCopies

    def _wait(self, timeout: float) -> None: ...
    def _bring_back(self) -> None: ...
    def _lose(self, node_id: str) -> None: ...

    def _where(self, node_id: str) -> str:
        return f"node {self._ip_of.get(node_id, node_id[:12])}"

    def _ask(self, call: str, *args, timeout: float = CALL_TIMEOUT) -> dict[str, object]:
        """Every agent of the job at once: node id -> its answer, or the exception its call
        raised (a dead agent's Ray error, an agent's LaunchError)."""
        refs = {n: getattr(a, call).remote(*args) for n, a in self._agents.items() if n not in self._lost}
        out: dict[str, object] = {}
        for node_id, ref in refs.items():
            try:
                out[node_id] = self._ray.get(ref, timeout=timeout)
            except Exception as exc:  # broad: whatever Ray calls a dead agent, or the agent's error
                out[node_id] = exc
        return out

    def lost(self) -> str | None:
        if self.closed or self._stopped:
            return "the job's processes were stopped"
        if self._polls:
            self._wait(0)  # exits the agents reported since the last cell (kept for events())
        for node_id in self._lost:
            return f"taas's agent on {self._where(node_id)} died (its process or the node was killed)"
        gone = next((e for e in self._pending if isinstance(e, ProcessExit)), None)
        if gone is not None:
            return f"{gone.key} ended ({_how(gone.returncode)})"
        for node_id, answer in self._ask("lost").items():
            if isinstance(answer, Exception):
                self._lose(node_id)
                return f"taas's agent on {self._where(node_id)} did not answer ({message(answer)})"
            if answer:
                return str(answer)
        return None

    def next_cell(self, files: dict[str, bytes], payload: str, result: str) -> None:
        lost = self.lost()
        if lost is not None:
            raise KeptRanksGone(lost)
        if self._copies.paths:  # the notebook's changes since the last cell reach the nodes' copies
            self._copies.ship({n: self._agents[n] for n in self._copies.paths}, self._ip_of)
        ref = self._ray.put(files)  # once, for every node
        answers = self._ask("next_cell", ref, payload, result)
        errors = [f"{self._where(n)}: {message(a)}" for n, a in answers.items() if isinstance(a, Exception)]
        if any(isinstance(getattr(a, "cause", a), KeptRanksGone) for a in answers.values()):
            # A node's kept ranks went after lost() looked (a rank's exit not yet reported
            # there): the cell runs on fresh ranks.  Ranks elsewhere that got it are stopped
            # with the kept job, before it could get far (it waits on the missing ranks).
            raise KeptRanksGone("; ".join(errors))
        if errors:
            raise LaunchError("the kept ranks are gone: " + "; ".join(errors))

    def cell_done(self) -> None:
        """What the cell's writers changed in the nodes' copies of the working directory
        comes back now, as after a one-cell job (RayJob._bring_back), not when the ranks end."""
        if self._copies.paths:
            self._bring_back()
            self._copies.again()

    def interrupt(self, keys) -> list[str]:
        by_node: dict[str, list[str]] = defaultdict(list)
        for key in keys:
            if key in self._node_of and key not in self._exited:
                by_node[self._node_of[key]].append(key)
        refs = [self._agents[n].interrupt.remote(k) for n, k in by_node.items() if n not in self._lost]
        sent: list[str] = []
        for ref in refs:
            try:
                sent += self._ray.get(ref, timeout=_INTERRUPT_TIMEOUT)
            except Exception:  # broad: a dead agent's ranks died with it (the watch sees their exits)
                pass
        return sent

    def running_pids(self) -> dict[str, int]:
        return {k: p for k, p in self._pids.items() if k not in self._exited}

    def memory(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for answer in self._ask("memory", timeout=10).values():
            if isinstance(answer, dict):
                out.update(answer)
        return out

    def reserved(self) -> str | None:
        if not self._reserving or self._let_go:
            return None
        per_node = Counter(self._ip_of.get(self._node_of[k], "?") for k in self._ranks if k in self._node_of)
        return "GPUs reserved on the cluster: " + ", ".join(
            f"{n} on {ip}" for ip, n in sorted(per_node.items()))
