"""What crosses between kernel and ranks, as data: pickled one way, unpickled as the other side
sees it (no processes here)."""

import pickle
import sys

import pytest
import torch

from taas.job import crossing


def roundtrip(value, direction):
    return pickle.loads(crossing.dumps(value, direction))


def test_ipython_exit_and_get_ipython_arrive_as_their_plain_python_meaning():
    from IPython.core.autocall import ExitAutocall
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        values = {"exit": ExitAutocall(shell), "get_ipython": shell.get_ipython}
        arrived = roundtrip(values, crossing.TO_RANK)
    finally:
        InteractiveShell.clear_instance()
    assert arrived["exit"] is sys.exit
    assert arrived["get_ipython"]() is None


def test_other_bound_methods_are_untouched():
    assert roundtrip([1, 2].__len__, crossing.TO_RANK)() == 2


def test_wrappers_in_results_come_back_as_what_they_wrap_wherever_they_are():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        net = torch.nn.Linear(2, 2)
        ddp = DDP(net)
        back = roundtrip({"m": ddp, "l": [ddp], "net": net}, crossing.TO_KERNEL)
    finally:
        dist.destroy_process_group()
    assert type(back["m"]) is torch.nn.Linear
    assert back["l"][0] is back["m"] is back["net"]  # one object, as in the rank
    assert crossing.unwrap(ddp) is net


def test_training_arguments_leave_their_process_state_behind(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    blob = crossing.dumps(args, crossing.TO_RANK)
    assert b"PartialState" not in blob and b"_setup_devices" not in blob
    back = pickle.loads(blob)
    assert back.world_size == 1 and back.output_dir == str(tmp_path) and str(back.device) == "cpu"


def test_a_shipped_function_keeps_its_file_name():
    """The cell's file name is what maps a rank's traceback to the notebook cell's lines
    (cloudpickle >= 3.1.3 would ship every function as "<dynamic-code>")."""
    namespace: dict = {}
    exec(compile("def f(x):\n    return 1 / x\n", "/tmp/ipykernel_1/123.py", "exec"), namespace)
    f = pickle.loads(crossing.dumps(namespace["f"], crossing.TO_RANK))
    assert f.__code__.co_filename == "/tmp/ipykernel_1/123.py"
    assert f(2) == 0.5
