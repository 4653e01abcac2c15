"""This machine's GPUs that the ranks may use, by UUID: NVML when it imports (no CUDA context,
and the memory other programs use), else torch's device properties.

``CUDA_VISIBLE_DEVICES`` set by a spawner (JupyterHub, a container runtime, the user) is
honoured as CUDA reads it: indices or UUID prefixes, in that order, up to the first entry that
names no GPU; an empty value hides every GPU.  Only those GPUs are offered, and each keeps its
place in that list as its index.

Tests and CPU machines: ``TAAS_FAKE_GPUS`` (``UUID[:USED_MIB],...``) replaces the hardware, so
that leases, waiting and the ranks' environment run on a machine with no GPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from taas.leases.api import BUSY_MIB, Gpu

FAKE = "TAAS_FAKE_GPUS"


def busy_mib(environ: Mapping[str, str] = os.environ) -> int:
    value = environ.get("TAAS_GPU_BUSY_MIB", "")
    return int(value) if value.isdigit() else BUSY_MIB


def visible(machine: Sequence[Gpu], cuda_visible: str | None) -> list[Gpu]:
    """The GPUs of ``machine`` (indexed as the machine numbers them) that ``cuda_visible``
    (``CUDA_VISIBLE_DEVICES``, None: unset) leaves, indexed as the ranks see them."""
    if cuda_visible is None:
        return [Gpu(g.uuid, i, g.used_mib) for i, g in enumerate(machine)]
    out: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        if entry.isdigit():
            found = [g for g in machine if g.index == int(entry)]
        else:
            found = [g for g in machine if entry and g.uuid.startswith(entry if entry.startswith("GPU-")
                                                                         else f"GPU-{entry}")]
        if len(found) != 1 or any(g.uuid == found[0].uuid for g in out):
            break  # CUDA stops at the first entry it cannot use
        out.append(Gpu(found[0].uuid, len(out), found[0].used_mib))
    return out


def fake(spec: str) -> list[Gpu]:
    """``UUID[:USED_MIB],...`` as the machine's GPUs."""
    out = []
    for i, item in enumerate(x for x in spec.split(",") if x.strip()):
        uuid, _, used = item.strip().partition(":")
        out.append(Gpu(uuid, i, int(used) if used.isdigit() else 0))
    return out


def gpus(environ: Mapping[str, str] = os.environ, fallback: bool = True) -> list[Gpu]:
    """The GPUs this process's ranks may use, lowest index first (``fallback=False``: NVML's
    only, none without it: the terminal's ``taas jobs`` never imports torch)."""
    if environ.get(FAKE) is not None:
        return visible(fake(environ[FAKE]), environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        machine = _nvml()  # every GPU of the machine, in its own order
    except Exception:  # no pynvml, no driver library: torch, which applies CUDA_VISIBLE_DEVICES itself
        return _torch() if fallback else []
    return visible(machine, environ.get("CUDA_VISIBLE_DEVICES"))


def _nvml() -> list[Gpu]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out.append(Gpu(uuid, i, _used_by_others(pynvml, handle)))
        return out
    finally:
        pynvml.nvmlShutdown()


def _used_by_others(pynvml, handle) -> int:
    """MiB used on this GPU by processes other than this one (the notebook's own tensors are
    not "busy outside"); the whole used memory where NVML cannot list processes."""
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sum((p.usedGpuMemory or 0) for p in procs if p.pid != os.getpid()) // (1 << 20)
    except Exception:  # not supported here (some containers): the device's whole use
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) // (1 << 20)


def _torch() -> list[Gpu]:
    """No NVML: the visible GPUs' UUIDs from torch's device properties (this initialises CUDA:
    only ever called in the kernel, which never forks ranks).  Memory used by others: unknown."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [Gpu(f"GPU-{torch.cuda.get_device_properties(i).uuid}", i)
            for i in range(torch.cuda.device_count())]
