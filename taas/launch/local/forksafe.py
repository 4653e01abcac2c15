"""The start process never forks with CUDA initialised: a checked invariant.

Forked children of a process that initialised CUDA cannot use CUDA ("Cannot re-initialize CUDA
in forked subprocess"), which is why accelerate's ``notebook_launcher`` and Lightning's
``ddp_notebook`` refuse a kernel that touched CUDA.  taas never forks the kernel: the kernel
starts the start process as a fresh interpreter (:mod:`taas.launch.local.launcher`), and only
that process forks ranks.  So the kernel may use CUDA freely, and the start process must not:
it counts no devices, and :func:`refusal` is asked right before every fork.

The start process also sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (:func:`avoid_cuda_init`) before
it imports torch, so that ``torch.cuda.is_available()`` in anything it imports asks NVML instead
of initialising the CUDA driver (``cuInit``, which also poisons fork).
"""

from __future__ import annotations

import os
import sys

# Tests only: the path of a file whose existence makes :func:`cuda_initialized` answer True in
# the start process (a CPU machine cannot initialise CUDA; the check must still be seen to work).
TEST_HOOK = "TAAS_TEST_CUDA_INITIALIZED"

REFUSAL = ("the taas start process found CUDA initialised before forking the job's processes "
           "(something it imported touched CUDA); it is being restarted: run the cell again")


def avoid_cuda_init(environ=os.environ) -> None:
    """Before ``import torch`` in the start process: availability checks through NVML."""
    environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def cuda_initialized() -> bool:
    """Whether this process initialised CUDA (never initialises it itself: torch is only
    consulted if something already imported it)."""
    fake = os.environ.get(TEST_HOOK)
    if fake and os.path.exists(fake):
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a torch without CUDA support, or one half-imported: no CUDA context
        return False


def refusal() -> str | None:
    """The one-line reason not to fork now, or None when forking is safe."""
    return REFUSAL if cuda_initialized() else None
