"""Metrics drawn in the cell, through a real kernel: ``taas.log`` in ranks, the live plot (one
display updated in place), ``taas.metrics()`` afterwards, bad values noted once, the notebook's
own ``taas.log``, Hugging Face's and Lightning's Trainers feeding it with no code change, and
10,000 logged steps."""

from __future__ import annotations

import ast

import pytest

from tests.support.kernel_driver import OFFLINE, cell
from tests.support.notebooks import tiny_bert_notebook
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel

KERNEL_ENV = OFFLINE  # Hugging Face offline in the kernel and its ranks


def rows(kernel, job: str = "last") -> list[dict]:
    run = kernel.run(f"import taas\nm = taas.metrics({job!r})\n"
                     "print(repr(m.to_dict('records') if hasattr(m, 'to_dict') else m))")
    assert run.error is None, run.traceback
    return ast.literal_eval(run.stdout.strip().replace("nan", "None"))


def plots(run) -> list[tuple[str, dict]]:
    return [(kind, data) for kind, data in run.displays if "image/png" in data]


def test_rank_scalars_are_drawn_in_place_and_every_row_comes_back(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import taas, torch.distributed as dist
        rank = dist.get_rank()
        for step in range(50):
            taas.log(step=step, loss=1.0 / (step + 1) + rank, acc=step / 50)
        taas.log(step=50, loss=float("nan"), shape=[1, 2])
        taas.log(step=51, loss=float("nan"), shape=[3])
        print("logged", rank)
        """))
    assert run.error is None, run.traceback
    assert "[rank0] logged 0" in run.stdout and "[rank1] logged 1" in run.stdout
    # one note per bad name and rank, and the job went on
    assert per_rank(run.stderr).count("'loss' is nan, not a finite number: not recorded") == 2, run.stderr
    assert per_rank(run.stderr).count("'shape' is a list of 2, not a number") == 2, run.stderr
    assert "a list of 1" not in run.stderr
    drawn = plots(run)
    assert drawn, run.displays
    assert drawn[0][0] == "display_data" and all(kind == "update_display_data" for kind, _ in drawn[1:])
    assert "loss" in drawn[-1][1]["text/plain"] and "(step 49)" in drawn[-1][1]["text/plain"]
    got = rows(kernel)
    assert len(got) == 100
    assert {(r["rank"], r["step"]) for r in got} == {(r, s) for r in (0, 1) for s in range(50)}
    first = next(r for r in got if r["rank"] == 1 and r["step"] == 0)
    assert first["loss"] == 2.0 and first["acc"] == 0.0


def test_notebook_log_and_all_jobs(kernel, clean):
    run = kernel.run("import taas\ntaas.log(step=7, score=0.5)\ntaas.log(score=[1])")
    assert run.error is None, run.traceback
    assert "'score' is a list of 1, not a number" in run.stderr
    assert rows(kernel, "notebook") == [{"step": 7, "rank": None, "score": 0.5}]
    every = rows(kernel, "all")
    # With pandas, the table has every job's columns (the notebook's row: None in the others).
    assert any(r["job"] is None and r["rank"] is None and r["step"] == 7 and r["score"] == 0.5 for r in every), every
    assert any(r["job"] is not None and r["rank"] == 1 for r in every)


def test_hugging_face_trainer_logs_feed_the_plot_and_history(kernel, clean, workdir):
    setup = kernel.run(tiny_bert_notebook(str(workdir / "hf-metrics"), use_cpu=True, logging_steps=1))
    assert setup.error is None, setup.traceback
    run = kernel.run("%%taas --gpus 2\ntrainer = Trainer(model, args, train_dataset=ds)\ntrainer.train()")
    assert run.error is None, run.traceback
    assert plots(run), run.displays
    got = rows(kernel)
    losses = [(r["rank"], r["step"]) for r in got if r.get("loss") is not None]
    assert {(0, s) for s in range(1, 5)} <= set(losses), got
    assert any(r.get("train_runtime") is not None for r in got)


def test_lightning_trainer_metrics_feed_the_plot_and_history(kernel, clean, workdir):
    run = kernel.run(cell(f"""
        %%taas --gpus 2
        import torch, pytorch_lightning as pl
        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)
            def training_step(self, batch, i):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.net(x), y)
                self.log("train_loss", loss)
                return loss
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, log_every_n_steps=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir={str(workdir / "pl")!r})
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
        print("fitted", trainer.global_step)
        """))
    assert run.error is None, run.traceback
    assert "[rank0] fitted 6" in per_rank(run.stdout), run.stdout
    assert plots(run), run.displays
    got = rows(kernel)
    steps = sorted(r["step"] for r in got if r["rank"] == 0 and r.get("train_loss") is not None)
    assert steps[:6] == [1, 2, 3, 4, 5, 6], got


def test_ten_thousand_steps_keep_the_cell_and_kernel_responsive(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import taas, time
        started = time.perf_counter()
        for step in range(10_000):
            taas.log(step=step, loss=1.0 / (step + 1), lr=0.1)
        print(f"per call {(time.perf_counter() - started) / 10_000 * 1e6:.1f} us")
        """))
    assert run.error is None, run.traceback
    drawn = plots(run)
    assert 1 <= len(drawn) <= 30, len(drawn)  # at most about one draw a second
    count = kernel.run("import taas\nprint(len(taas.metrics()))")
    assert count.stdout.strip() == "20000", count.stdout + count.stderr
