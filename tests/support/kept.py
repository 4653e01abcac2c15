"""Kept ranks (``--keep``) scenarios shared by the one-machine and cluster real-kernel tests
(tests/kernel/test_keep*.py, tests/cluster/test_keep*.py): the same promise, checked the same way
wherever the ranks run; only how a test finds the ranks' pids differs."""

from __future__ import annotations

import time
from typing import Callable

from tests.support.kernel_driver import cell, plain
from tests.support.ranks import per_rank


def ok(run):
    """``run``, after asserting that the cell did not fail (its output otherwise)."""
    assert run.error is None, run.stdout + run.stderr + run.traceback
    return run


def typo_and_interrupt_keep_the_state(kernel, world: int, rank_pids: Callable[[], list[int]],
                                      named: str = "rank0") -> list[int]:
    """Kept ranks of ``world`` survive a NameError on every rank and an interrupt while every
    rank runs Python: both shown as usual (the interrupt with where each rank was, ``named``
    among them), the same processes and namespace after each.  Returns the ranks' pids; the
    ranks stay kept (the caller releases them and checks they end)."""
    ok(kernel.run(f"%%taas --gpus {world} --keep\nimport os, time\npid = os.getpid()\nkept = 'yes'"))
    pids = rank_pids()
    run = kernel.run("%%taas\nkept_typo")
    assert run.error is not None and run.error["ename"] == "JobFailed"
    assert "NameError" in plain(run.traceback) and "line 2" in plain(run.traceback)
    assert ok(kernel.run("%%taas\nkept + str(os.getpid() == pid)")).result == "'yesTrue'"

    seen = {}

    def on_output(out):  # every rank is in the loop: interrupt now
        if all(f"[rank{r}] spinning" in per_rank(out.stdout) for r in range(world)) and "at" not in seen:
            seen["at"] = time.monotonic()
            kernel.km.interrupt_kernel()

    run = kernel.run("%%taas\nprint('spinning', flush=True)\nwhile True:\n    time.sleep(0.05)",
                     on_output=on_output)
    assert "at" in seen, run.stdout + run.stderr
    assert run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.stderr
    assert time.monotonic() - seen["at"] < 10
    text = plain(run.traceback)
    assert "the kept ranks and their state stay" in text, text
    assert named in text and ("line 4" in text or "line 3" in text), text  # where each rank was
    assert rank_pids() == pids
    assert ok(kernel.run("%%taas\nkept + str(os.getpid() == pid)")).result == "'yesTrue'"
    return pids


def loader_failure_cell(loader: str, marks: str) -> str:
    """A kept cell that reads registered loader ``loader`` (one worker) and shows the error
    its ranks' code gets from it; each rank first leaves a file ``rank<N>`` in ``marks``, so a
    loader made to fail only then knows every rank is in the cell's code."""
    return cell(f"""
        %%taas --cpus 1
        import time
        open(os.path.join({marks!r}, f"rank{{os.environ['RANK']}}"), "w").close()
        try:
            for b in {loader}:
                time.sleep(0.01)
        except Exception as exc:  # the ranks' cell code gets the loader's error
            print("GOT", type(exc).__name__, exc, flush=True)
            raise
        """)
