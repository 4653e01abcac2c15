"""Where tensors land when they cross (taas.job.devices), as data on CPU.

The rule is a pure function.  The pickling path runs with CPU tensors standing in for CUDA ones:
the kernel side's ``recorded`` says every storage is on ``cuda:1``, and the rank side's
placement puts them on ``meta`` (so a test sees that they moved) or ``cpu`` (to read values)."""

from __future__ import annotations

import os

import pytest
import torch

from taas.job import crossing, devices, package, results
from taas.job.memory import bigvalues
from taas.job.memory.bigvalues import BigValues

MIB = 1 << 20


def on_cuda1(storage):
    return "cuda:1"


# -- the rule ----------------------------------------------------------------------------------
RULE = [  # recorded, LOCAL_RANK, rank's device -> target
    ("cuda:0", 3, "cuda", "cuda:3"),  # every rank its own GPU, never all on cuda:0
    ("cuda:0", 0, "cuda", "cuda:0"),
    ("cuda:5", 0, "cuda", "cuda:0"),  # whichever GPU the notebook used
    ("cuda", 2, "cuda", "cuda:2"),
    ("cuda:1", 1, "cuda:7", "cuda:1"),  # a rank's GPU is cuda:LOCAL_RANK
    ("cuda:0", 2, "cpu", "cpu"),  # CPU ranks: on the CPU, never a GPU the job does not own
    ("cpu", 3, "cuda", "cpu"),  # only CUDA values move
    ("meta", 1, "cuda", "meta"),
]


@pytest.mark.parametrize("recorded, local_rank, rank_device, target", RULE,
                         ids=[f"{r[0]}@{r[1]}-{r[2]}" for r in RULE])
def test_target_device(recorded, local_rank, rank_device, target):
    assert devices.target_device(recorded, local_rank, rank_device) == target
    assert devices.placement(rank_device, local_rank)(recorded) == target


def test_only_cuda_storages_are_recorded():
    assert devices.cuda_recorded(torch.ones(2).untyped_storage()) is None
    assert devices.cuda_recorded(torch.ones(2, device="meta").untyped_storage()) is None


def test_the_default_placement_reads_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices._default_place("cuda:0") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices._default_place("cuda:0") == "cuda:3"


# -- to the ranks ------------------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers too
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor


def _values():
    base = torch.arange(24, dtype=torch.float32)
    return {
        "base": base,
        "view": base[4:12].view(2, 4),
        "nested": {"list": [base[::3], (torch.ones(3, dtype=torch.int64),)], "obj": Holder(base[1:])},
        "param": torch.nn.Parameter(torch.randn(3)),
        "model": Net(),
    }


def _ship_and_land(values, place, big=None, recorded=on_cuda1):
    seen = []

    def record(recorded_on):
        seen.append(recorded_on)
        return place

    return package.unship(package.ship(values, big=big, recorded=recorded), place=record), seen


def test_values_land_where_the_rank_places_them_with_storages_shared():
    got, seen = _ship_and_land(_values(), "meta")
    storages = {t.untyped_storage()._cdata for t in
                (got["base"], got["view"], got["nested"]["list"][0], got["nested"]["obj"].tensor)}
    assert len(storages) == 1  # four views of one storage stay views of one storage
    assert got["view"].shape == (2, 4) and got["view"].storage_offset() == 4
    for tensor in (got["base"], got["nested"]["list"][1][0], got["param"], *got["model"].parameters(),
                   *got["model"].buffers()):
        assert tensor.device.type == "meta"
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    model = got["model"]
    assert model.head.weight is model.embed.weight  # tied weights stay tied
    # one placement per storage, each asked with the recorded device
    # base, the int64 ones, param, the model's 3 parameters (tied: one) and 3 buffers
    assert seen == ["cuda:1"] * 9


def test_values_arrive_equal_and_views_alias_on_the_target():
    values = _values()
    got, _ = _ship_and_land(values, "cpu")
    assert torch.equal(got["base"], values["base"]) and torch.equal(got["view"], values["view"])
    assert torch.equal(got["nested"]["list"][0], values["base"][::3])
    assert torch.equal(got["model"].embed.weight, values["model"].embed.weight)
    got["base"][5] = -1.0
    assert got["view"][0, 1].item() == -1.0  # one storage in the rank
    assert values["base"][5].item() == 5.0  # never the notebook's


def test_each_storage_is_copied_to_host_once(monkeypatch):
    calls = []
    real = devices.host_bytes
    monkeypatch.setattr(devices, "host_bytes", lambda storage: calls.append(storage.nbytes()) or real(storage))
    base = torch.zeros(1000)
    package.ship({"a": base, "b": base[10:], "c": [base[::2], base.view(10, 100)]}, recorded=on_cuda1)
    assert calls == [4000]


def test_only_recorded_storages_are_mapped():
    keep = torch.ones(4)
    move = torch.zeros(4)
    recorded = lambda s: "cuda:0" if s.data_ptr() == move.data_ptr() else None  # noqa: E731
    got = package.unship(package.ship({"keep": keep, "move": move}, recorded=recorded), place=lambda r: "meta")
    assert got["keep"].device.type == "cpu" and got["move"].device.type == "meta"


def test_cpu_views_stay_views_of_one_storage_and_stay_resizable():
    """torch pickles a TypedStorage per tensor, each on its own: views arrived as copies."""
    base = torch.arange(8.0)
    got = package.unship(package.ship({"base": base, "view": base[2:], "pair": (base[::2],)}))
    got["base"][2] = -1.0
    assert got["view"][0].item() == -1.0 and got["pair"][0][1].item() == -1.0
    assert got["base"].device.type == "cpu" and got["base"].untyped_storage().resizable()
    got["base"].resize_(100)  # torch's own memory, as after torch.load


def test_meta_tensors_travel_as_torch_pickles_them():
    got = package.unship(package.ship({"m": torch.empty(3, 2, device="meta")}))
    assert got["m"].device.type == "meta" and got["m"].shape == (3, 2)


def test_big_device_storages_go_once_through_shared_memory(tmp_path, monkeypatch):
    big = BigValues("devjob", directory=str(tmp_path), threshold=MIB)
    try:
        base = torch.randn(MIB // 2)  # 2 MiB
        other = torch.randn(MIB // 4)  # 1 MiB
        small = torch.randn(10)  # inline
        values = {"base": base, "view": base[100:], "again": [base, other], "other": other, "small": small}
        blob = package.ship(values, big=big, recorded=on_cuda1)
        assert len(big.fds) == 2 and big.written == 3 * MIB  # each storage's bytes written once
        assert len(blob) < 64 * 1024 and os.listdir(tmp_path) == []  # unnamed: nothing left behind
        monkeypatch.setenv(bigvalues.SHARED_FDS_ENV, ",".join(map(str, big.fds)))
        for place in ("cpu", "meta"):
            got = package.unship(blob, place=lambda r, place=place: place)
            assert got["view"].untyped_storage()._cdata == got["base"].untyped_storage()._cdata
            assert got["again"][0] is got["base"] and got["small"].device.type == place
        got = package.unship(blob, place=lambda r: "cpu")
        assert torch.equal(got["base"], base) and torch.equal(got["other"], other)
        got["base"][0] = 1234.0  # copy-on-write: never another rank's values
        assert package.unship(blob, place=lambda r: "cpu")["base"][0].item() == base[0].item()
    finally:
        big.unlink()


def test_no_room_or_no_descriptor_left_pickles_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(bigvalues, "MAX_FDS", 0)
    big = BigValues("devjob", directory=str(tmp_path), threshold=MIB)
    try:
        base = torch.randn(MIB // 2)
        blob = package.ship({"x": base}, big=big, recorded=on_cuda1)
        assert big.fds == [] and len(blob) > 2 * MIB
        assert torch.equal(package.unship(blob, place=lambda r: "cpu")["x"], base)
    finally:
        big.unlink()


# -- results back ------------------------------------------------------------------------------
RESULTS_RULE = [  # --results-device, CUDA devices the kernel sees -> on the CPU
    ("cpu", 0, True),
    ("cpu", 8, True),  # by default, always: the kernel never holds a rank's GPU
    ("keep", 8, False),
    ("keep", 0, True),  # nothing to keep them on
]


@pytest.mark.parametrize("results_device, kernel_cuda, to_cpu", RESULTS_RULE)
def test_results_to_cpu(results_device, kernel_cuda, to_cpu):
    assert results.results_to_cpu(results_device, kernel_cuda) is to_cpu


def test_results_cross_as_host_copies_with_storages_shared():
    model = Net()
    state = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "view": model.embed.weight[1]}
    hook = devices.DeviceStorages(land="cpu", recorded=lambda s: "cuda:0").reduce
    got = crossing.load_result(crossing.dumps(state, crossing.TO_KERNEL, hook))[0]
    assert got["model"].head.weight is got["model"].embed.weight
    assert got["view"].untyped_storage()._cdata == got["model"].embed.weight.untyped_storage()._cdata
    assert got["opt"].param_groups[0]["params"][0] is next(got["model"].parameters())
    assert torch.equal(got["model"].embed.weight, model.embed.weight)
    assert got["model"].embed.weight.data_ptr() != model.embed.weight.data_ptr()  # a copy
    assert model.embed.weight.device.type == "cpu"  # rank 0's own objects untouched


def test_results_kept_on_their_device_land_on_the_recorded_one():
    base = torch.arange(6.0)
    hook = devices.DeviceStorages(land="keep", recorded=lambda s: "meta").reduce
    got = crossing.load_result(crossing.dumps({"a": base, "b": base[2:]}, crossing.TO_KERNEL, hook))[0]
    assert got["a"].device.type == "meta" and got["b"].storage_offset() == 2
    assert got["a"].untyped_storage()._cdata == got["b"].untyped_storage()._cdata


def test_results_keep_cpu_values_as_they_are():
    sent = results.collect({"t": torch.arange(3), "m": torch.nn.Linear(2, 2)}, ("t", "m"), None, to_cpu=True)
    got = results.load(sent)
    assert torch.equal(got.values["t"], torch.arange(3)) and got.values["m"].weight.device.type == "cpu"
