"""Rendezvous for one job attempt: torchrun's environment per rank, and the store.

:func:`torchrun_env` is pure (tested as data): given where a rank was placed, the variables
``torchrun`` would give it, so that code written for torchrun (``init_process_group("env://")``,
Hugging Face, accelerate, Lightning) runs unchanged.  :func:`agent_store` hosts the job's
TCPStore in the launcher's process, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``):
the ranks connect to it and none of them has to bind a port.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its node (``group_rank`` of ``group_world`` nodes) and its place
    on that node (``local_rank`` of ``local_world``)."""

    rank: int
    local_rank: int
    local_world: int
    group_rank: int = 0
    group_world: int = 1


def one_node(world: int) -> list[Placement]:
    """Every rank on this machine: local rank = rank."""
    return [Placement(rank, rank, world) for rank in range(world)]


def torchrun_env(place: Placement, world: int, master_addr: str, master_port: int, run_id: str,
                 restart: int = 0, max_restarts: int = 0) -> dict[str, str]:
    """The variables torchrun (``torch.distributed.run``) sets for this rank."""
    return {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(place.local_world),
        "GROUP_RANK": str(place.group_rank),
        "GROUP_WORLD_SIZE": str(place.group_world),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def loopback_ifname() -> str | None:
    """The loopback interface's name (``lo``), if this machine has one."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else None


def ifname_for(ip: str) -> str | None:
    """The network interface that carries ``ip`` on this machine (what gloo's and NCCL's
    ``*_SOCKET_IFNAME`` want), or None if none does.  Any 127.x address is loopback's (a
    simulated cluster gives its nodes 127.0.1.x: routed to ``lo``, not assigned to it)."""
    import ipaddress

    try:
        if ipaddress.ip_address(ip).is_loopback:
            return loopback_ifname()
    except ValueError:
        return None
    try:
        import psutil
    except ImportError:  # psutil is optional here: without it, leave the choice to gloo/NCCL
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


def agent_store(world: int, host: str = "127.0.0.1"):
    """A fresh TCPStore for one attempt, listening on ``host`` (loopback by default): ``(store,
    port)``.

    TCPStore's own server listens on every interface (``::``); so we create the listening
    socket ourselves, on ``host`` only, port 0 (the OS picks: two kernels never race for a
    port), and hand it over as ``master_listen_fd``; from then on the store owns it (and
    closes it when the store is freed)."""
    import torch.distributed as dist

    from taas.shield import deferred_interrupt

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(min(max(world, 128), socket.SOMAXCONN))
        port = listener.getsockname()[1]
        # The store takes the socket as one step: a Ctrl-C between its creation and the detach
        # would have both close it (the second close hits whatever file has that number now).
        with deferred_interrupt():
            store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                                  master_listen_fd=listener.fileno())
            listener.detach()
    except BaseException:  # Ctrl-C included: close the socket the store did not take; re-raised
        listener.close()  # nothing when the store took it (detached)
        raise
    return store, port
