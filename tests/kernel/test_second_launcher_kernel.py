"""The launcher contract, proven by a second implementation (tests/support/private_launcher.py: a fresh
interpreter per process, a private root per process, nothing shared through files) running the
core real-kernel tests unchanged: results back, torchrun's environment, a failing rank's
traceback, exits and signals, the timeout and its hang doctor, interrupt, the storage rule and the
merge of the ranks' layers, restarts."""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import Kernel, OFFLINE

# Collected here, they run with this module's ``kernel`` fixture.
from tests.kernel.test_kernel import (  # noqa: F401
    test_a_failing_rank_shows_its_traceback_with_cell_lines,
    test_exits_and_signals_stop_the_job,
    test_hang_is_stopped_by_timeout,
    test_interrupt_stops_every_rank,
    test_magic_form_and_torchrun_environment,
    test_only_rank_zero_writes_the_working_directory,
    test_pragma_cell_runs_ranks_with_notebook_code_and_brings_results_back,
)
# The interrupt variant: it waits for the ranks' output, not for a deadline that a fresh
# interpreter's `import torch` may pass on a busy machine.
from tests.kernel.test_doctor_kernel import test_interrupt_shows_where_every_rank_was  # noqa: F401
from tests.kernel.test_restarts_kernel import test_a_failed_attempt_restarts_and_reads_rank_zeros_checkpoint  # noqa: F401
from tests.kernel.test_storage_kernel import test_every_rank_writes_its_own_files_and_they_all_come_back  # noqa: F401

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def kernel(workdir):
    k = Kernel(str(workdir), env=dict(OFFLINE, TAAS_LAUNCHER="tests.support.private_launcher:PrivateLauncher"))
    run = k.run("import taas; print(type(taas._loaded['session'].launcher).__name__)")
    assert run.stdout.strip() == "PrivateLauncher", run.stdout + run.traceback
    yield k
    k.shutdown()


@pytest.fixture
def unchanged():
    yield  # the storage module's mount-table check is about the local launcher's namespaces
