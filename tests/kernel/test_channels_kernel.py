"""End to end: taas's internal channels ignore what they cannot read, and the job goes on.

A rank's own code can write anything to the events pipe (its fd is in ``TAAS_EVENTS_FD``, in
the rank's environment for all to see); the kernel must neither fail the job nor lose its output
and results over a line it cannot read.
"""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import cell
from tests.support.ranks import per_rank

pytestmark = pytest.mark.kernel


def test_malformed_event_lines_do_not_fail_the_job(kernel, clean):
    run = kernel.run(cell("""
        %%taas --gpus 2
        import os
        fd = int(os.environ["TAAS_EVENTS_FD"])
        for line in (b'{"kind": "display", "data": 5}\\n', b'not json\\n', b'[1, 2]\\n',
                     b'{"kind": "stack", "frames": 7}\\n', b'{"kind": "comm", "ops": "many"}\\n',
                     b'{"kind": "data.progress", "loader": 3}\\n', b'"just a string"\\n'):
            os.write(fd, line)
        print("wrote them", flush=True)
        answer = 40 + 2
    """))
    assert run.status == "ok", run.traceback + run.stderr
    out = per_rank(run.stdout)
    assert "[rank0] wrote them" in out and "[rank1] wrote them" in out, run.stdout
    check = kernel.run("print(answer)")
    assert check.status == "ok" and check.stdout.strip() == "42", check.stdout + check.traceback
