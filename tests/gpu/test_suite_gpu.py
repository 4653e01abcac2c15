"""taas on a real GPU, through :class:`taas.session.Session` (the GPU machine has no Jupyter):
a 1-rank NCCL job, Hugging Face's Trainer on one GPU, a registered loader feeding GPU batches
from pinned memory, a 1 GiB CUDA value to the rank and a 1 GiB CUDA result back, results on CPU
and the GPU freed after the job.  Only correctness here; ``benchmarks/gpu.py`` times them.

NCCL cannot put two ranks on one GPU, and the machine has one: every job is ``--gpus 1``
(multi-rank logic is tested on gloo, on CPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.harness import gpu_returns_to, notebook
from tests.support.notebooks import tiny_bert_notebook

GiB = 1 << 30


def test_a_one_rank_nccl_job_has_its_gpu_and_an_initialised_group(run, clean):
    r = run("""
        import os
        import torch
        import torch.distributed as dist
        t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        facts = dict(backend=dist.get_backend(), rank=dist.get_rank(), world=dist.get_world_size(),
                     local_rank=int(os.environ["LOCAL_RANK"]), current=torch.cuda.current_device(),
                     device=str(t.device), total=float(t.sum()))
        facts
        """).ok()
    assert r.values["facts"] == dict(backend="nccl", rank=0, world=1, local_rank=0, current=0,
                                     device="cuda:0", total=4.0)
    assert r.stats.backend == "nccl" and r.stats.device == "cuda"
    assert r.values["t"].device.type == "cpu"  # results come back on CPU (issue 15, item 2)


def test_results_come_back_on_cpu_and_the_gpu_is_freed_after_the_job(run, clean, gpu_baseline):
    namespace: dict = {}
    r = run("""
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()).cuda()
        ballast = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # 512 MiB the rank holds
        y = model(torch.ones(8, 1024, device="cuda"))
        where = str(next(model.parameters()).device)
        """, namespace=namespace).ok()
    assert r.values["where"] == "cuda:0"
    assert {p.device.type for p in namespace["model"].parameters()} == {"cpu"}
    assert namespace["y"].device.type == "cpu" and namespace["ballast"].device.type == "cpu"
    # The notebook still holds the results: none of them keeps GPU memory.
    above = gpu_returns_to(gpu_baseline)
    assert above <= 256 << 20, f"{above / 2**20:.0f} MiB still used on GPU 0 after the job"
    namespace.clear()


def test_hugging_face_trainer_trains_on_the_ranks_gpu(run, clean, tmp_path):
    namespace = notebook(tiny_bert_notebook(str(tmp_path / "hf-out")))
    r = run("""
        from transformers import Trainer
        trainer = Trainer(model, args, train_dataset=ds)
        out = trainer.train()
        seen = dict(device=str(next(trainer.model.parameters()).device), n_gpu=args.n_gpu,
                    world=args.world_size, steps=out.global_step)
        model = trainer.model
        """, namespace=namespace).ok()
    assert r.values["seen"] == dict(device="cuda:0", n_gpu=1, world=1, steps=4), r.text
    assert type(namespace["model"]).__name__ == "BertForSequenceClassification"
    assert {p.device.type for p in namespace["model"].parameters()} == {"cpu"}
    assert "never communicated" not in r.text


def test_a_registered_loader_feeds_gpu_batches_from_pinned_memory(run, clean):
    import taas
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(64, dtype=torch.float32).repeat_interleave(4096).view(64, 4096),
                         torch.arange(64))
    loader = DataLoader(data, batch_size=8)
    taas.register(loader)
    try:
        r = run("""
            import torch
            pinned, labels, total = [], [], 0.0
            length = len(loader)
            for x, y in loader:
                pinned.append(x.is_pinned() and y.is_pinned())
                x = x.to("cuda", non_blocking=True)
                total += float(x.sum())
                labels += y.tolist()
            """, "--gpus 1 --cpus 2", namespace={"loader": loader}).ok()
    finally:
        taas.unregister(loader)
    assert r.values["length"] == 8
    assert r.values["pinned"] == [True] * 8  # issue 15, item 4
    assert r.values["labels"] == list(range(64))  # units in order
    assert r.values["total"] == float(sum(range(64)) * 4096)


def test_a_1_gib_cuda_value_reaches_the_rank_and_a_1_gib_cuda_result_comes_back(run, clean):
    n = GiB // 4  # float32
    namespace = {"big": torch.full((n,), 1.0, device="cuda")}
    try:
        r = run("""
            import torch
            seen = dict(device=str(big.device), total=float(big.sum(dtype=torch.float64)))
            result = torch.full((big.numel(),), 2.0, device=big.device)
            del big
            """, namespace=namespace).ok()
        assert r.values["seen"] == dict(device="cuda:0", total=float(n))
        result = namespace["result"]
        assert result.device.type == "cpu" and result.numel() == n
        assert float(result.sum(dtype=torch.float64)) == 2.0 * n
    finally:
        namespace.clear()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("what", ["tensor", "module"])
def test_a_failing_nccl_job_leaves_nothing_on_the_gpu(run, clean, what):
    """A rank that fails holding GPU memory: the job fails with the rank's error, and its
    memory goes with it (``clean``), as after a job that succeeded."""
    r = run(f"""
        import torch
        held = torch.empty(256 * 2**20, device="cuda") if {what!r} == "tensor" else torch.nn.Linear(4096, 4096).cuda()
        raise ValueError("boom on the GPU rank")
        """)
    assert r.error is not None and "boom on the GPU rank" in str(r.error) + r.text
