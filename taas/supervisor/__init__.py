"""Watching one started job to its end, for the session.

    machine.py    the job's states and transitions, as a table (pure)
    supervisor.py the run over attempts: start, watch (output, events, failure, timeout,
                  stall, Ctrl-C), stop, restart, merge the ranks' files, fetch the results
    events.py     what processes say on their events pipes, read into typed messages; a line
                  that is not one is logged and ignored, never fails a job
    diagnosis.py  where the ranks are (stack requests) and why a job failed (their reports)
    prompts.py    the ranks' questions (input(), pdb) asked in the notebook's input box, in turn

May import: taas.errors, taas.shield, taas.ready, taas.io, taas.job, taas.workdir, taas.launch (the
launcher contract, never a launcher), taas.launch.process (the stdin wire's answer type) and
taas.data (the data plane the session built).  Only
the session imports this room.
"""
