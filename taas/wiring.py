"""The composition root's plain choices (:mod:`taas.session` makes them per cell): which
launcher runs jobs by default (``TAAS_LAUNCHER``), which data transport reaches the ranks where
a launcher's topology puts them, what every process of a job gets in its environment, and which
names the cell reads still refer to a registered loader that was rebound since.

May import what the session may, less the supervisor and the rank runtime: it only chooses.
"""

from __future__ import annotations

import functools
import os

from taas.errors import LaunchError
from taas.launch.api import Topology
from taas.launch.local.launcher import LocalLauncher


# The ranks' process-group timeout when the cell sets no --timeout.  Long on purpose: a rank in
# the debugger (or at input()) keeps its peers waiting in their next collective for as long as
# the user takes, and they must not time out under it.  A real hang is taas's to find (the
# panel, --stall, --timeout, an interrupt), not the group timeout's.
GROUP_TIMEOUT = 7 * 24 * 3600.0


def group_timeout(timeout: float | None) -> float:
    """The ranks' process-group timeout for a cell with ``--timeout`` (None: without).  With
    one, a minute past it: taas's own ``--timeout`` ends the job first and shows where every
    rank was; a group timeout of the same length raced it, and on a busy machine gloo's bare
    "Timed out waiting" sometimes won.  The group's is only a backstop."""
    return float(timeout) + 60.0 if timeout else GROUP_TIMEOUT


def transport_for(topology: Topology):
    """The data plane's transport where ``topology`` puts the ranks: shared memory when every
    process runs on the kernel's machine, else TCP streams into a relay per node."""
    if topology.kernel_machine:
        from taas.data.shm.transport import ShmTransport

        return ShmTransport
    from taas.data.tcp.transport import TcpTransport

    return functools.partial(TcpTransport, host=topology.host, ranks_per_node=topology.rank_nodes,
                             node_ids=topology.node_ids)


def launcher_from_env():
    """The launcher named by ``TAAS_LAUNCHER`` (``"module:Class"``, for a second implementation
    of :mod:`taas.launch.api`), else the local one."""
    name = os.environ.get("TAAS_LAUNCHER", "")
    if not name:
        return LocalLauncher()
    import importlib

    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError, ValueError) as exc:
        raise LaunchError(f"TAAS_LAUNCHER={name!r} names no launcher ({exc}); unset it to use "
                          "the local one") from None


def process_env(world: int) -> dict[str, str]:
    """What every process of a job gets besides the launcher's rendezvous variables."""
    env = {"MPLBACKEND": "module://taas.rank.mpl_backend", "PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    return env


def rebound_loaders(namespace: dict, values: dict) -> list[str]:
    """Notes for names the cell (or a notebook function it calls) reads that referred to a
    registered loader and were assigned again since (see ``registry.rebound``)."""
    from taas.data import registry
    from taas.job.package import _referenced_globals

    if not registry._entries:
        return []
    registry.remember_names(namespace)
    names, seen, stack = set(values), set(), list(values.values())
    while stack:  # globals read by notebook functions and classes, transitively
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for name, ref in _referenced_globals(value).items():
            names.add(name)
            stack.append(ref)
    return registry.rebound(namespace, names)
