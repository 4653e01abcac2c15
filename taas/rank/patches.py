"""Make ordinary notebook code behave inside a rank.

* ``init_process_group`` becomes idempotent: the default group is already up when the cell
  starts, and DataSphere-style cells call ``init_process_group(backend='nccl',
  init_method='env://')`` themselves.  A second call is a no-op; after a user's
  ``destroy_process_group`` a new call initialises again, on gloo when this job runs on CPU.
* ``nn.DataParallel(m)`` becomes ``DistributedDataParallel`` over the job's group: DataParallel
  over every GPU inside each of N ranks is never what a ``--gpus N`` user wants.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_noted = False


def install(device: str) -> None:
    _patch_init_process_group(device)
    _patch_data_parallel(device)


def _patch_init_process_group(device: str) -> None:
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "_taas", False):
        return

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if dist.is_initialized():
            return None
        if device == "cpu" and backend is not None and "nccl" in str(backend).lower():
            backend = "gloo"  # the job runs on CPU: same code, CPU collectives
        return original(backend, *args, **kwargs)

    init_process_group._taas = True
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _patch_data_parallel(device: str) -> None:
    class DataParallel(DistributedDataParallel):
        """``nn.DataParallel`` inside a taas rank: DistributedDataParallel over the job."""

        def __init__(self, module, device_ids=None, output_device=None, dim=0):
            global _noted
            if not _noted and dist.get_rank() == 0:
                # An INFO note (taas.io.output's rule): what taas did, nothing to fix: stdout.
                print("taas: nn.DataParallel inside a rank runs as DistributedDataParallel "
                      "over the job's ranks", flush=True)
            _noted = True
            if device == "cuda":
                current = torch.cuda.current_device()
                super().__init__(module.to(current), device_ids=[current], dim=dim)
            else:
                super().__init__(module, dim=dim)

    import torch.nn as nn
    import torch.nn.parallel as parallel
    import torch.nn.parallel.data_parallel as data_parallel

    DataParallel.__module__ = "torch.nn"
    nn.DataParallel = parallel.DataParallel = data_parallel.DataParallel = DataParallel
