"""A kernel's warm job host on a Ray cluster, ready for its next detached cell.

A detached cell's host is a Ray actor that imports torch and starts node agents of its own
(seconds, and many of them on a busy cluster); the cell waited for all of it.  After a
detached cell, the kernel has the next host made ahead: a detached :class:`JobHost` actor named
``taas-spare-<owner>-<token>``, warming itself from its creation on (taas.host.ray.actor).  The
next detached cell hands its job to it (the job's ``host`` key names it, for ``%taas jobs``,
attach and cancel).

A spare is made for the session's settings of that moment (cluster address, working-directory
rule, ``TAAS_*`` variables): a cell with others gets a fresh host, and the spare is let go.  A
spare holds no GPU (no placement group until it has a job); it ends when the kernel lets it go
(``close``, ``%unload_ext``) or, by itself, when the kernel that made it is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets

from taas.host.ray import keys

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Spare:
    handle: object  # the actor
    name: str
    settings: tuple  # what it was made for (see :func:`settings`)


def settings(address: str, workdir: str, workdir_limit: int | None) -> tuple:
    """What a host is made for (its environment included): the job must match it to take it."""
    return (address, workdir, workdir_limit, tuple(sorted(host_env().items())))


def host_env() -> dict:
    """The variables a job host actor gets: the kernel's ``TAAS_*`` and where taas is imported from."""
    from taas.launch.ray.cluster import _taas_root

    env = {name: value for name, value in os.environ.items() if name.startswith("TAAS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_taas_root(), os.environ.get("PYTHONPATH")]))
    return env


def new_host(ray, owner: str, name: str, job_id: str, address: str, workdir: str,
             workdir_limit: int | None):
    """A detached JobHost actor named ``name`` (``job_id`` "": a spare)."""
    from taas.host.ray.actor import JobHost

    return ray.remote(JobHost).options(
        name=name, namespace=keys.NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=4,
        max_restarts=0, runtime_env={"env_vars": host_env()},
    ).remote(owner, job_id, address, workdir, workdir_limit)


class ClusterSpares:
    """This kernel's spare job host on a cluster (at most one)."""

    def __init__(self) -> None:
        self._spare: Spare | None = None
        self._ray = None

    def take(self, launcher, workdir: str, workdir_limit: int | None) -> Spare | None:
        """The spare, if it was made for these settings and is still there; else None (and a
        spare for other settings is let go)."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.settings != settings(launcher.address, workdir, workdir_limit):
            self._kill(spare)
            return None
        try:  # ended meanwhile (it took its kernel for gone, it crashed): a new host instead
            self._ray.get_actor(spare.name, namespace=keys.NAMESPACE)
        except Exception as exc:  # broad: ValueError for no such actor; any other: cannot tell
            log.debug("the spare is gone: %r", exc)
            return None
        return spare

    def prewarm(self, launcher, workdir: str, workdir_limit: int | None) -> None:
        """Have a spare made for these settings (the cluster makes it while the kernel goes on)."""
        if self._spare is not None:
            return
        try:
            self._spare = self.make(launcher, workdir, workdir_limit)  # it warms itself
        except Exception as exc:  # broad: no spare; the next detached cell makes its host
            log.debug("no spare host: %r", exc)

    def make(self, launcher, workdir: str, workdir_limit: int | None, name: str | None = None) -> Spare:
        """A new host for these settings, warming itself from its creation on, named ``name``
        (default: a spare's name).  Until it is given a job it ends itself if this kernel goes."""
        ray = self._ray = launcher.connect()
        owner = keys.owner()
        name = name or keys.spare_name(owner, secrets.token_hex(8))
        handle = new_host(ray, owner, name, "", launcher.address, workdir, workdir_limit)
        return Spare(handle, name, settings(launcher.address, workdir, workdir_limit))

    def cuda_devices(self, spare: Spare, timeout: float) -> int:
        """The CUDA devices the ranks of a job on ``spare`` will see (its GPU nodes' agents,
        started by it: the kernel starts none); a LaunchError if it cannot say."""
        from taas.errors import LaunchError
        from taas.launch.ray.cluster import message

        try:
            return int(self._ray.get(spare.handle.cuda_devices.remote(), timeout=timeout))
        except Exception as exc:  # broad: any Ray error means no host to run the job
            raise LaunchError(f"taas: could not start a job host on the cluster: {message(exc)}") from None

    def give_back(self, spare: Spare) -> None:
        """``spare`` (taken, given no job) is the spare again, or let go if there is one."""
        if self._spare is None:
            self._spare = spare
        else:
            self._kill(spare)

    def let_go(self, spare: Spare) -> None:
        """``spare`` (taken, given no job) ends: it could not serve."""
        self._kill(spare)

    def close(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            self._kill(spare)

    def _kill(self, spare: Spare) -> None:
        try:
            self._ray.kill(spare.handle)
        except Exception as exc:  # broad: gone already (its kernel watch), or the cluster is
            log.debug("letting the spare go: %r", exc)
