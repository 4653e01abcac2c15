"""End to end: where the ranks were when a job hangs, is interrupted or stalls (taas.io.hang)."""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.support.kernel_driver import INTERRUPT, Replies, cell
from tests.support.launchers import on_both_launchers
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


# Rank 1 waits in a barrier while the others wait in an all_reduce: nobody ever returns.
# Cell lines: the directive is line 1, so `dist.barrier()` is line 6, `dist.all_reduce(t)` line 8.
MISMATCH = """    import torch, torch.distributed as dist
    t = torch.ones(1)
    print('blocking', flush=True)
    if dist.get_rank() == 1:
        dist.barrier()
    else:
        dist.all_reduce(t)
"""


def test_timeout_shows_where_every_rank_was_and_names_the_odd_one(kernel, clean):
    # --timeout counts from the launch: the start process is warmed first, so that even on a
    # loaded machine the ranks reach the cell's code long before the timeout (cold, importing
    # torch on two busy cores took more than 5 s, and the ranks were still in init_process_group).
    assert kernel.run("%%taas --gpus 3\npass").error is None
    run = kernel.run(cell("%%taas --gpus 3 --timeout 10\n" + textwrap.dedent(MISMATCH)))
    assert run.status == "error"
    lines = run.error["traceback"]
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))
    first = text.splitlines()[0]
    assert "ran past --timeout 10s" in first and "rank1 is not where the others are" in first, text
    assert "rank1: line 6 dist.barrier()" in text, text
    assert "rank0,2: line 8 dist.all_reduce(t)" in text, text
    assert "--- rank1 ---" in text and "Python stacks" in text, text
    assert re.search(r"Cell In\[\d+\], line 6\n    dist.barrier\(\)", text), text


@on_both_launchers
def test_interrupt_shows_where_every_rank_was(kernel, clean):
    seen = {}

    def on_output(out):
        # The stall line proves the ranks sit in their collectives; then the user interrupts.
        if "taas: no output for 1 s" in out.stderr and "at" not in seen:
            seen["at"] = out.stderr
            kernel.km.interrupt_kernel()

    run = kernel.run(cell("%%taas --gpus 3 --stall 1\n" + textwrap.dedent(MISMATCH)), on_output=on_output)
    assert "at" in seen
    stall = [line for line in seen["at"].splitlines() if "no output for" in line][0]
    assert "rank0,2: line 8 dist.all_reduce(t) | rank1: line 6 dist.barrier()" in stall, stall
    assert run.status == "error" and run.error["ename"] == "KeyboardInterrupt"
    text = "\n".join(run.error["traceback"])
    assert "the job was interrupted" in text, text
    assert "rank1 is not where the others are" in text and "rank1: line 6 dist.barrier()" in text, text
    assert "rank0,2: line 8 dist.all_reduce(t)" in text, text


def test_a_rank_that_left_is_not_where_the_others_are(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 3 --timeout 5
        import sys, torch, torch.distributed as dist
        t = torch.ones(1)
        if dist.get_rank() == 1:
            sys.exit(0)
        dist.all_reduce(t)
    """))
    assert run.status == "error"
    text = re.sub(r"\x1b\[[0-9;]*m", "", run.error["traceback"][0])
    # Either gloo notices the peer left (the failure report names it), or the job runs past
    # the timeout and the doctor does: rank 1 is named either way.
    assert ("rank1 exited with code 0 (sys.exit) while the other ranks were still running" in text
            or "rank1" in text and "not where the others are" in text), text


def test_a_silent_job_says_where_it_is_once_per_stall_and_goes_on(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2 --stall 2
        import time
        print('go', flush=True)
        end = time.monotonic() + 6
        while time.monotonic() < end:
            time.sleep(0.1)
        print('done')
    """))
    assert run.error is None, run.traceback
    assert "[rank0] done" in per_rank(run.stdout) and "[rank1] done" in per_rank(run.stdout)
    stalls = [line for line in run.stderr.splitlines() if line.startswith("taas: no output for 2 s;")]
    # Start-up may be silent for 2 s too on a busy machine: those lines name no cell line.
    in_loop = [line for line in stalls if re.search(r"rank0-1: line [56] ", line)]
    assert len(in_loop) == 1, run.stderr


def _prompt(run) -> int:
    """The cell's ``In [N]`` as the front end shows it (the kernel's execute_input count)."""
    return next(m["content"]["execution_count"] for m in run.messages if m["msg_type"] == "execute_input")


def test_tracebacks_and_interrupt_stacks_name_the_cells_own_prompt(kernel, clean):
    # IPython 9 counts a cell before running it: tracebacks said "Cell In[4]" under prompt [3].
    failed = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError('rank one broke')
        dist.barrier()
        """))
    assert failed.status == "error"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(failed.error["traceback"]))
    assert f"Cell In[{_prompt(failed)}], line 4" in text, (_prompt(failed), text)
    assert re.findall(r"Cell In\[(\d+)\]", text) == [str(_prompt(failed))], text

    seen = {}

    def on_output(out):
        # Both ranks' line (collapsed as one when identical): both are in the cell.
        if re.search(r"\[rank(0-1|0,1|1)\] sleeping", out.stdout) and "at" not in seen:
            seen["at"] = True
            kernel.km.interrupt_kernel()

    interrupted = kernel.run(cell("""
        %%taas --gpus 2
        import time
        print('sleeping', flush=True)
        time.sleep(600)
        """), on_output=on_output)
    assert interrupted.status == "error" and interrupted.error["ename"] == "KeyboardInterrupt"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(interrupted.error["traceback"]))
    # Each rank's stack names the cell as its prompt does.
    assert re.findall(r"Cell In\[(\d+)\], line 4", text) == [str(_prompt(interrupted))] * 2, text


# -- a rank asks the user: input() and the debugger (taas.rank.console) -------------------------
def _text(run) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", run.traceback)


def test_input_reads_the_notebooks_input_box_on_one_rank_then_on_two_in_turn(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        name = input('name? ') if dist.get_rank() == 0 else None
        print('hello', name)
    """), replies=Replies(("name? ", "Ada")))
    assert run.error is None, run.stderr + run.traceback
    assert run.prompts == ["[rank0] name? "]
    assert "[rank0] hello Ada" in run.stdout and "[rank1] hello None" in run.stdout
    assert kernel.run("name").result == "'Ada'"  # rank 0's names come back as ever
    # Both ranks ask at once: served one after another, each prompt tagged with its rank.
    both = kernel.run(cell("""
        %%taas --gpus 2
        word = input('word? ')
        print('got', word)
    """), replies=Replies(("word? ", lambda p: p.split("]")[0][1:]), ("word? ", lambda p: p.split("]")[0][1:])))
    assert both.error is None, both.stderr + both.traceback
    assert sorted(both.prompts) == ["[rank0] word? ", "[rank1] word? "]
    assert "[rank0] got rank0" in both.stdout and "[rank1] got rank1" in both.stdout
    # A front end that does not allow stdin (nbconvert, nbval): one line in the rank.
    batch = kernel.run("%%taas --gpus 2\ninput('x? ')", batch=True)
    assert batch.status == "error"
    first = _text(batch).splitlines()[0]
    assert re.fullmatch(r"rank[01] failed: taas\.StdinUnavailable: this front end does not allow stdin: "
                        r"input\(\) and pdb in a rank need an interactive notebook", first), first


@on_both_launchers
def test_breakpoint_on_rank1_p_n_c_then_q_stops_the_job_in_one_line(kernel, clean):
    body = """
        %%taas --gpus 2
        import torch, torch.distributed as dist
        x = torch.ones(1) * dist.get_rank()
        if dist.get_rank() == 1:
            breakpoint()
            y = x + 1
        dist.all_reduce(x)
        print('sum', x.item())
    """
    pdb = "(Pdb) [rank1] "
    run = kernel.run(cell(body), replies=Replies((pdb, "p x"), (pdb, "n"), (pdb, "p y"), (pdb, "c")))
    assert run.error is None, run.stderr + run.traceback
    assert run.prompts == [pdb] * 4  # only rank 1 asked; rank 0 waited in all_reduce meanwhile
    assert "[rank1] -> y = x + 1" in run.before_prompt[0]  # pdb stopped at the next line
    assert "[rank1] tensor([1.])" in run.before_prompt[1]  # p x
    assert "[rank1] -> dist.all_reduce(x)" in run.before_prompt[2]  # n
    assert "[rank1] tensor([2.])" in run.before_prompt[3]  # p y
    assert "[rank0-1] sum 1.0" in run.stdout  # c: the collective completed
    quit = kernel.run(cell(body), replies=Replies((pdb, "q")))
    assert quit.status == "error"
    lines = _text(quit).strip().splitlines()
    assert lines == ["rank1 left the debugger (q): the job was stopped", "rank0: stopped after rank1 failed"]


def test_an_interrupt_at_the_debuggers_prompt_stops_the_job(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import torch.distributed as dist
        if dist.get_rank() == 1:
            import pdb; pdb.set_trace()
            print('not reached')
        dist.barrier()
    """), replies=Replies(("(Pdb) [rank1] ", INTERRUPT)))
    assert run.status == "error" and run.error["ename"] == "KeyboardInterrupt"
    text = _text(run)
    assert "rank1 was in the debugger; the others waited for it." in text, text
    assert "rank1: in the debugger at line" in text and "rank0: line 6 dist.barrier()" in text, text
    assert "[rank1] not reached" not in run.stdout  # (pdb's listing shows the line)
    assert kernel.run("%%taas --gpus 2\n1 + 1").result == "2"  # the next taas cell works


def test_pdb_on_opens_the_failing_ranks_frame_before_the_job_ends(kernel, clean):
    assert kernel.run("%pdb on").error is None
    try:
        run = kernel.run(cell("""
            %%taas --gpus 2
            import torch.distributed as dist
            def inverse(v):
                return 1 / v
            if dist.get_rank() == 1:
                z = inverse(0)
            dist.barrier()
        """), replies=Replies(("(Pdb) [rank1] ", "p v"), ("(Pdb) [rank1] ", "q")))
    finally:
        kernel.run("%pdb off")
    # Only rank 1's debugger asked (IPython's own did not open in taas's frames).
    assert run.prompts == ["(Pdb) [rank1] "] * 2
    assert "[rank1] -> return 1 / v" in run.before_prompt[0]  # the frame that raised
    assert "[rank1] 0" in run.before_prompt[1].split("return 1 / v")[-1]
    text = _text(run)
    assert text.splitlines()[0] == "rank1 failed: ZeroDivisionError: division by zero", text
    assert "return 1 / v" in text and "rank0: stopped after rank1 failed" in text  # as today
