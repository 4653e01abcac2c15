"""A GPU node's share of a TCP-transport job: which ranks are on it, and the names of what its
relay makes there (per loader a header segment ``taas-<job>-n<node>-<loader>`` with its blocks,
and the FIFO directory ``<tmp>/taas-<job>-relay-n<node>``), and their removal -- by whole
names (:func:`taas.data.shm.segment.names_of`), so that one attempt's removal never touches
the next attempt's (``taas-<job>-1-n0-0``)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from taas.data.shm import segment


def header_name(job_id: str, node: int, loader: int) -> str:
    return f"{segment.SHM_PREFIX}{job_id}-n{node}-{loader}"


def fifo_directory(job_id: str, node: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{segment.SHM_PREFIX}{job_id}-relay-n{node}")


def node_of(rank: int, nodes) -> int:
    """The GPU node of ``rank``: ``nodes`` is ranks per node (rank r on node r // nodes, every
    node alike), a sequence giving each rank's node (a launcher's placement: nodes may hold
    different numbers of ranks), or None (one node)."""
    if not nodes:
        return 0
    if isinstance(nodes, int):
        return rank // nodes
    return int(nodes[rank])


def remove_node(job_id: str, node: "int | None" = None) -> None:
    """Unlink node ``node``'s segments of job attempt ``job_id`` and remove its FIFO directory
    (and a staging one a killed relay left); ``node`` None: every node's on this machine.
    Whole names only (:func:`taas.data.shm.segment.names_of`): never another attempt's."""
    number = "[0-9]+" if node is None else str(int(node))
    segment.unlink_matching(segment.names_of(job_id, f"-n{number}"))
    directories = re.compile(re.escape(f"{segment.SHM_PREFIX}{job_id}-relay-n") + number
                             + "(?:-new-[A-Za-z0-9_]+)?")  # fifo_directory(); mkdtemp's staging
    tmp = tempfile.gettempdir()
    try:
        found = [n for n in os.listdir(tmp) if directories.fullmatch(n)]
    except OSError:
        found = []
    for name in found:
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
