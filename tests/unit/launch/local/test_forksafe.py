"""The start process never forks with CUDA initialised (a checked invariant), and taas counts
GPUs without initialising CUDA.  On CPU the check is made to see an initialised CUDA through
its test hook (forksafe.TEST_HOOK)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from taas.errors import LaunchError
from taas.launch.api import LaunchSpec, ProcessExit, ProcessSpec, cuda_device_count
from taas.launch.local import forksafe, protocol
from taas.launch.local.launcher import LocalLauncher


def _spec(tmp_path, entry="echo"):
    return LaunchSpec(f"f{time.monotonic_ns()}", str(tmp_path),
                      (ProcessSpec("rank0", f"tests.support.launch_targets:{entry}"),))


def _finish(job, timeout=60.0):
    deadline = time.monotonic() + timeout
    codes = {}
    while not codes:
        assert time.monotonic() < deadline, "job did not end"
        codes.update({ev.key: ev.returncode for ev in job.events(0.05) if isinstance(ev, ProcessExit)})
    list(job.drain())
    job.close()
    return codes


def _gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_start_process_with_cuda_initialised_refuses_in_one_line_and_is_replaced(tmp_path, monkeypatch):
    flag = tmp_path / "cuda-initialised"
    monkeypatch.setenv(forksafe.TEST_HOOK, str(flag))  # the start process inherits the kernel's environment
    launcher = LocalLauncher()
    try:
        launcher.start(_spec(tmp_path)).close()  # a first job: the start process is up, children forked ahead
        first = launcher.starter_pid
        children = [p.pid for p in psutil.Process(first).children(recursive=True)]
        flag.touch()  # from now on the start process sees CUDA initialised
        with pytest.raises(LaunchError) as info:
            launcher.start(_spec(tmp_path))
        message = str(info.value)
        assert message == forksafe.REFUSAL and "\n" not in message
        assert _gone(first), "the start process that saw CUDA initialised must exit"
        assert all(_gone(pid) for pid in children), "nothing of it is left behind"
        flag.unlink()
        job = launcher.start(_spec(tmp_path))  # the next job works, in a fresh start process
        assert launcher.starter_pid != first
        assert _finish(job) == {"rank0": 0}
    finally:
        launcher.shutdown()


def test_the_start_process_asks_nvml_for_cuda_availability(monkeypatch):
    environ: dict[str, str] = {}
    forksafe.avoid_cuda_init(environ)
    assert environ == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    environ = {"PYTORCH_NVML_BASED_CUDA_CHECK": "0"}  # a user's explicit choice stays
    forksafe.avoid_cuda_init(environ)
    assert environ == {"PYTORCH_NVML_BASED_CUDA_CHECK": "0"}


def test_the_check_reads_torch_only_if_already_imported(monkeypatch):
    monkeypatch.delenv(forksafe.TEST_HOOK, raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert forksafe.refusal() is None and "torch" not in sys.modules


def test_the_check_sees_torch_cuda_initialised(monkeypatch):
    import torch

    monkeypatch.delenv(forksafe.TEST_HOOK, raising=False)
    assert forksafe.refusal() is None  # this CPU process never initialised CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert forksafe.refusal() == forksafe.REFUSAL


def _gpus_cuda_would_show(visible: str | None) -> int | None:
    """The GPUs a process would see, counted without torch: nvidia-smi's list (none without
    nvidia-smi or a torch built without CUDA), less what ``CUDA_VISIBLE_DEVICES`` (``visible``)
    hides -- its entries up to the first index that names no GPU.  None where this cannot
    tell (MIG instances)."""
    import torch

    smi = shutil.which("nvidia-smi")
    if torch.version.cuda is None or smi is None:
        return 0
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        return 0
    if "MIG" in listed.stdout:
        return None
    gpus = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    if visible is None:
        return gpus
    shown = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or (entry.lstrip("-").isdigit() and not 0 <= int(entry) < gpus):
            break
        shown += 1
    return min(shown, gpus)


# cuda_device_count() in a fresh interpreter (torch counts once per process), with
# is_available refused: [count, whether CUDA got initialised].
_COUNT_IN_A_FRESH_PROCESS = """
import json, torch
def refuse():
    raise AssertionError("is_available initialises the driver")
torch.cuda.is_available = refuse
from taas.launch.api import cuda_device_count
count = cuda_device_count()
print(json.dumps([count, torch.cuda.is_initialized()]))
"""


def test_counting_gpus_never_initialises_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("is_available initialises the driver"))
    expected = _gpus_cuda_would_show(os.environ.get("CUDA_VISIBLE_DEVICES"))
    count = cuda_device_count()
    assert count == expected or expected is None, (count, expected)
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("visible", ["", "0"])
def test_gpus_hidden_by_cuda_visible_devices_are_not_counted(visible):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    done = subprocess.run([sys.executable, "-c", _COUNT_IN_A_FRESH_PROCESS], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count, initialised = json.loads(done.stdout.strip().splitlines()[-1])
    assert not initialised
    if visible == "":
        assert count == 0  # every GPU hidden
    else:
        expected = _gpus_cuda_would_show(visible)
        assert count == expected or expected is None, (count, expected)
        assert count <= 1


def test_gpus_are_counted_once_per_cuda_visible_devices_setting(monkeypatch):
    """torch loads NVML anew on each count before CUDA is initialised: a kept cell must not pay
    that every time, yet a changed CUDA_VISIBLE_DEVICES is counted again."""
    import torch

    from taas.launch import api

    calls = []
    monkeypatch.setattr(api, "_counted", {})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append(os.environ.get("CUDA_VISIBLE_DEVICES")) or 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert [cuda_device_count() for _ in range(5)] == [3] * 5
    assert calls == ["0,1,2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cuda_device_count() == 3  # what torch said for the new setting (the fake says 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    cuda_device_count()
    assert calls == ["0,1,2", "0"]


def test_a_spawn_error_says_whether_the_start_process_is_exiting():
    assert protocol.SpawnError("j", "no").replace is False
    message = protocol.decode(protocol.encode(protocol.SpawnError("j", "no", replace=True)))
    assert message == protocol.SpawnError("j", "no", replace=True)
