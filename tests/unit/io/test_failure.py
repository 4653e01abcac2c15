"""Root cause of a failed job, as data: who is named, and how."""

import pytest

from taas.io import failure

LOST = {"time": 0, "exit_code": 1, "message": "",
        "chain": [{"type": "DistBackendError", "module": "torch", "frames": [], "relation": None,
                   "text": "torch.distributed.DistBackendError: Connection closed by peer [127.0.0.1]:1"}]}
ERROR = {"time": 0, "exit_code": 1, "message": "",
         "chain": [{"type": "ValueError", "module": "builtins", "frames": [], "relation": None,
                    "text": "ValueError: bad"}]}
SYS_EXIT_0 = {"time": 0, "exit_code": 0, "message": "exited with code 0 (sys.exit)",
              "chain": [{"type": "SystemExit", "module": "builtins", "frames": [], "relation": None,
                         "text": "SystemExit: 0"}]}


def end(key, code, at, record=None, stopped=False):
    return failure.ProcessEnd(key, code, at, dict(record, time=at) if record else None, stopped=stopped)


@pytest.mark.parametrize("ends, root, line", [
    # a real error beats a peer's lost connection, even a slightly earlier one
    ([end("rank0", 1, 1.0, LOST), end("rank1", 1, 1.1, ERROR)], "rank1", "rank1 failed: ValueError: bad"),
    # rank 1 left with sys.exit(0); rank 0's all_reduce lost its peer
    ([end("rank1", 0, 1.0, SYS_EXIT_0), end("rank0", 1, 1.01, LOST)], "rank1",
     "rank1 exited with code 0 (sys.exit) while the other ranks were still running"),
    # os._exit(0): no report; the supervisor saw the exit after rank 0 wrote its error
    ([end("rank0", 1, 1.0, LOST), end("rank1", 0, 1.05)], "rank1",
     "rank1 exited (code 0) while the other ranks were still running"),
    # a third rank the supervisor stopped is no cause, though its exit says SIGTERM
    ([end("rank0", 1, 1.0, LOST), end("rank1", 0, 1.05), end("rank2", -15, 1.2, stopped=True)], "rank1",
     "rank1 exited (code 0) while the other ranks were still running"),
    # a rank that finished is no cause of a real error
    ([end("rank0", 0, 1.0), end("rank1", 1, 2.0, ERROR)], "rank1", "rank1 failed: ValueError: bad"),
    # a signal death with no report is a cause
    ([end("rank0", -9, 1.0), end("rank1", 1, 1.01, LOST)], "rank0", "rank0 was killed by SIGKILL"),
    # a segfault seen only after the stop began (rank 0's lost connection came first) is the cause
    ([end("rank0", 1, 1.0, LOST), end("rank1", -11, 1.2, stopped=True)], "rank1",
     "rank1 was killed by SIGSEGV"),
    # ... and so is any death the stop cannot have caused
    ([end("rank0", 1, 1.0, LOST), end("rank1", -6, 1.2, stopped=True)], "rank1",
     "rank1 was killed by SIGABRT"),
    # a rank that SIGKILLed itself, seen only after rank 1's lost connection began the stop
    ([end("rank1", 1, 1.0, LOST), end("rank0", -9, 1.2, stopped=True)], "rank0",
     "rank0 was killed by SIGKILL"),
    # a loader worker that was done before is no cause
    ([end("loader:dl:0", 0, 0.5), end("rank0", 1, 1.0, LOST), end("rank1", 0, 1.05)], "rank1",
     "rank1 exited (code 0) while the other ranks were still running"),
    # only lost connections and nobody left: the earliest
    ([end("rank0", 1, 1.2, LOST), end("rank1", 1, 1.0, LOST)], "rank1", "rank1 failed: torch.distributed"),
])
def test_root_cause(ends, root, line):
    found = failure.root_cause(ends)
    assert found.key == root
    assert failure.summary(found).startswith(line)


def test_no_failure_no_root_cause_even_when_a_rank_left_with_sys_exit_0():
    assert failure.root_cause([end("rank1", 0, 1.0, SYS_EXIT_0), end("rank0", 0, 2.0)]) is None


def test_rendering_a_rank_that_left_names_it_and_says_what_to_check():
    ends = [end("rank1", 0, 1.0, SYS_EXIT_0), end("rank0", 1, 1.01, LOST)]
    root = failure.root_cause(ends)
    lines = failure.render(root, [e for e in ends if e is not root], color=False)
    assert lines[0] == "rank1 exited with code 0 (sys.exit) while the other ranks were still running"
    assert any("every rank must make the same collective calls" in line for line in lines)
    assert lines[-1] == "rank0: stopped after rank1 exited"


def test_left_early_names_the_rank_in_a_timeout():
    ends = [end("rank1", 0, 1.0), end("rank0", -15, 9.0, stopped=True)]
    assert failure.left_early(ends).key == "rank1"
    assert failure.left_early([end("rank0", -15, 9.0, stopped=True)]) is None


def test_ranks_lost_with_their_node_are_named_with_it():
    # The Ray launcher's report for processes whose node's agent died (taas.launch.ray.job).
    node = {"time": 0, "exit_code": -9, "chain": [], "hint": None,
            "message": "was lost with node 127.0.1.2: taas's agent there died"}
    ends = [end("rank0", -15, 1.2, stopped=True), end("rank2", -9, 1.0, node),
            end("rank3", -9, 1.0, node, stopped=True)]
    root = failure.root_cause(ends)
    lines = failure.render(root, [e for e in ends if e is not root], color=False)
    assert lines == ["rank2 was lost with node 127.0.1.2: taas's agent there died",
                     "rank0: stopped after rank2 failed",
                     "rank3: was lost with node 127.0.1.2: taas's agent there died"]
