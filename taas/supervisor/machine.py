"""The states of one job, as a table: pure, tested as data.

::

                 ┌────────── launch failed ─────────────────────────────> FAILED
                 │
    PREPARING ───┴─ started ─┬─ (loaders) ─> PREFETCHING ─ loaders ready ─┐
        ▲                    └─ (none) ────────────────────────────────> RUNNING ─ all exited 0 ─> SUCCEEDED
        │                                     │                            │   (PREFETCHING too)
        │                                     └── failure | timeout | interrupt ──> STOPPING
        │                                                                             │ stopped
        │                        ┌──────────── the cause was a failure, restarts left ┤
        └──── restart ──── RESTARTING                                                 ├─ failure ──> FAILED
                                                                                      ├─ timeout ──> TIMED_OUT
                                                                                      └─ interrupt ─> INTERRUPTED

The transitions, in words:

* PREPARING: the attempt's data plane is opened and its processes started.  ``started`` goes to
  PREFETCHING when the job has registered loaders (the ranks wait for a first slice of units),
  else to RUNNING; ``launch failed`` ends the job FAILED; an ``interrupt`` ends it INTERRUPTED
  at once (nothing runs yet).
* PREFETCHING: ``loaders ready`` goes to RUNNING (a late one in RUNNING changes nothing).
* PREFETCHING and RUNNING: ``all exited 0`` is SUCCEEDED; the first ``failure``, ``timeout``
  or ``interrupt`` goes to STOPPING and becomes the *cause*.
* STOPPING: peers failing after the first change nothing; an ``interrupt`` becomes the cause
  (an interrupted job is never restarted).  ``stopped`` then ends the attempt: RESTARTING when
  the cause was a failure and restarts are left, else FAILED, TIMED_OUT or INTERRUPTED after
  the cause.
* RESTARTING: ``restart`` begins the next attempt in PREPARING (``restarts`` one higher, the
  cause forgotten); an ``interrupt`` ends the job INTERRUPTED.

Anything else is an :class:`InvalidTransition`: a bug in the supervisor, never a user's error.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class State(enum.Enum):
    PREPARING = "preparing"
    PREFETCHING = "prefetching"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed out"

    @property
    def final(self) -> bool:
        return self in (State.SUCCEEDED, State.FAILED, State.INTERRUPTED, State.TIMED_OUT)


class Ev(enum.Enum):
    STARTED = "started"
    LAUNCH_FAILED = "launch failed"
    LOADERS_READY = "loaders ready"
    ALL_EXITED = "all exited 0"
    FAILURE = "failure"
    TIMEOUT = "timeout"
    INTERRUPT = "interrupt"
    STOPPED = "stopped"
    RESTART = "restart"


S = State
_LIVE = (S.PREFETCHING, S.RUNNING)
_TABLE: dict[tuple[State, Ev], State] = {
    (S.PREPARING, Ev.STARTED): S.RUNNING,  # PREFETCHING when the job has loaders (Machine.on)
    (S.PREPARING, Ev.LAUNCH_FAILED): S.FAILED,
    (S.PREPARING, Ev.INTERRUPT): S.INTERRUPTED,
    (S.PREFETCHING, Ev.LOADERS_READY): S.RUNNING,
    (S.RUNNING, Ev.LOADERS_READY): S.RUNNING,  # a late progress event
    **{(s, Ev.ALL_EXITED): S.SUCCEEDED for s in _LIVE},
    **{(s, e): S.STOPPING for s in _LIVE for e in (Ev.FAILURE, Ev.TIMEOUT, Ev.INTERRUPT)},
    (S.STOPPING, Ev.FAILURE): S.STOPPING,  # peers failing after the first: same stop
    (S.STOPPING, Ev.INTERRUPT): S.STOPPING,  # the cause becomes the interrupt
    (S.STOPPING, Ev.STOPPED): S.FAILED,  # or RESTARTING / TIMED_OUT / INTERRUPTED (Machine.on)
    (S.RESTARTING, Ev.RESTART): S.PREPARING,
    (S.RESTARTING, Ev.INTERRUPT): S.INTERRUPTED,
}
_AFTER_STOP: dict[Ev | None, State] = {Ev.TIMEOUT: S.TIMED_OUT, Ev.INTERRUPT: S.INTERRUPTED}


class InvalidTransition(RuntimeError):
    pass


class Machine:
    """The states of one job (the module's diagram).  ``restarts``: attempts begun after the
    first; ``cause``: the event that made the current attempt stop."""

    def __init__(self, max_restarts: int = 0, has_loaders: bool = False):
        self.state = State.PREPARING
        self.max_restarts = max_restarts
        self.has_loaders = has_loaders
        self.restarts = 0
        self.cause: Ev | None = None
        self.history: list[State] = [self.state]

    def on(self, event: Ev) -> State:
        target = _TABLE.get((self.state, event))
        if target is None:
            raise InvalidTransition(f"{event.value!r} in state {self.state.value!r}")
        if target is S.RUNNING and self.state is S.PREPARING and self.has_loaders:
            target = S.PREFETCHING
        if target is S.STOPPING and (self.state is not S.STOPPING or event is Ev.INTERRUPT):
            self.cause = event
        if event is Ev.STOPPED:
            if self.cause is Ev.FAILURE and self.restarts < self.max_restarts:
                target = S.RESTARTING
            else:
                target = _AFTER_STOP.get(self.cause, S.FAILED)
        if event is Ev.RESTART:
            self.restarts += 1
            self.cause = None
        if target is not self.state:
            log.debug("job %s -> %s (%s)", self.state.value, target.value, event.value)
            self.history.append(target)
        self.state = target
        return target
