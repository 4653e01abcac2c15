"""Job records as tests make them (taas.jobs): one way to write a record with its defaults."""

from __future__ import annotations

import time

from taas.jobs.api import JobRecord, State


def make_record(job_id: str, state: State = State.DONE, *, age: float = 0.0, took: float = 1.0,
                **changes) -> JobRecord:
    """A record of a 2-rank job on this machine from train.ipynb, started ``age`` seconds ago;
    a finished one ended ``took`` seconds after it started.  ``changes`` override any field."""
    values = dict(id=job_id, state=state, ranks=2, where="this machine", started=time.time() - age,
                  notebook="train.ipynb", first_line="trainer.fit(model)")
    if state.final:
        values["ended"] = values["started"] + took
    values.update(changes)
    return JobRecord(**values)
