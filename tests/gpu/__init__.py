"""GPU checks: taas on a real CUDA device (NCCL ranks, pinned loader batches, CUDA values and
results, GPU memory after a job).  Skipped where ``torch.cuda.is_available()`` is False, so CI
and CPU machines collect them and report them skipped.

The GPU machine these run on has no Jupyter packages, so the tests drive
:class:`taas.session.Session` directly (what the magics call), through the fixtures of
``conftest.py``; they import taas, torch, psutil and ``tests.gpu.harness``, never
``tests.support.kernel_driver`` (jupyter_client).  Run all of it, benchmark included, with
``tools/gpu-suite.sh`` (see docs/gpu.md).
"""
