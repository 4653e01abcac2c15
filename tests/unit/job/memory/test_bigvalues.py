"""Big arrays travel through shared-memory files mapped copy-on-write: package.ship/unship with
a job id and a directory, no kernel."""

from __future__ import annotations

import ctypes
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from taas.errors import PackagingError
from taas.job.memory import bigvalues
from taas.job import package
from taas.job.memory import resident as resmem
from taas.job.memory.bigvalues import BigValues
from tests.support.heap import mmapped_floats
from taas.job.memory.resident import ResidentMemory

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4))
MIB = 1 << 20
N = MIB // 4  # float32 elements in 1 MiB: the threshold


@pytest.fixture
def big(tmp_path):
    shipment = BigValues("testjob", directory=str(tmp_path))
    yield shipment
    shipment.unlink()
    assert os.listdir(tmp_path) == []


def roundtrip(values: dict, big: BigValues) -> dict:
    return package.unship(package.ship(values, big=big))


def files(big: BigValues) -> list[str]:
    return sorted(os.listdir(big.directory))


def _nonleaf():
    leaf = torch.randn(N, requires_grad=True)
    return leaf * 2


TENSORS = {  # name: (make, travels through a file)
    "contiguous": (lambda: torch.arange(N, dtype=torch.float32), True),
    "transposed": (lambda: torch.randn(512, 1024).t(), True),
    "strided view with offset": (lambda: torch.randn(4 * N)[7::3], True),
    "bfloat16": (lambda: torch.randn(2 * N).bfloat16(), True),
    "bool": (lambda: torch.rand(2 * MIB) > 0.5, True),
    "requires grad": (lambda: torch.randn(N, requires_grad=True), True),
    "non-leaf (arrives as a leaf, as plain pickle does)": (_nonleaf, True),
    "sparse": (lambda: torch.randn(1024, 1024).relu().to_sparse(), True),
    "jagged nested": (lambda: torch.nested.nested_tensor(
        [torch.randn(N), torch.randn(N // 2)], layout=torch.jagged), True),
    "quantized": (lambda: torch.quantize_per_tensor(torch.randn(2 * MIB), 0.1, 0, torch.qint8), True),
    "small": (lambda: torch.arange(N - 1, dtype=torch.float32), False),
    "meta device": (lambda: torch.empty(4 * N, device="meta"), False),
}


@pytest.mark.filterwarnings("ignore:.*quantize", "ignore:TypedStorage is deprecated")  # torch's own
@pytest.mark.parametrize("name", list(TENSORS))
def test_tensors_arrive_equal_with_their_layout(name, big):
    make, via_file = TENSORS[name]
    value = make()
    expected = pickle.loads(pickle.dumps(value))  # what the ordinary path delivers
    got = roundtrip({"x": value}, big)["x"]
    assert type(got) is type(expected)
    assert (got.dtype, got.device, got.requires_grad, got.is_leaf) == \
        (expected.dtype, expected.device, expected.requires_grad, expected.is_leaf)
    assert got.is_nested or got.shape == value.shape  # a jagged size is a fresh symbol per load
    if got.is_quantized:
        assert torch.equal(got.int_repr(), value.int_repr()) and got.q_scale() == value.q_scale()
    elif got.layout == torch.strided and not got.is_nested and got.device.type == "cpu":
        assert (got.stride(), got.storage_offset()) == (value.stride(), value.storage_offset())
        assert torch.equal(got.detach(), value.detach())
    elif got.is_sparse:
        assert torch.equal(got.to_dense(), value.to_dense())
    elif got.is_nested:
        assert all(torch.equal(a, b) for a, b in zip(got.unbind(), value.unbind()))
    assert bool(files(big)) is via_file


def test_views_of_one_storage_stay_views_of_one_storage_written_once(big):
    base = torch.arange(2 * N, dtype=torch.float32)
    got = roundtrip({"base": base, "tail": base[N:], "ints": base.view(torch.int32)[:10],
                     "again": [base]}, big)
    assert len(files(big)) == 1
    assert got["again"][0] is got["base"]
    got["base"][N] = -1.0
    assert got["tail"][0].item() == -1.0  # one storage in the rank, as in the notebook
    assert got["ints"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert base[N].item() == N  # the notebook's tensor is not that storage


def test_a_module_keeps_its_parameters_and_shares_tied_weights(big):
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 128), torch.nn.Linear(128, 4096))
    model[1].weight = model[0].weight  # tied, as language models do
    got = roundtrip({"model": model}, big)["model"]
    assert type(got[0].weight) is torch.nn.Parameter and got[0].weight.requires_grad
    assert got[1].weight is got[0].weight
    assert torch.equal(got[0].weight, model[0].weight) and torch.equal(got[1].bias, model[1].bias)
    assert len(files(big)) == 1  # the 2 MiB embedding; the 16 KiB bias stays inline


@pytest.mark.parametrize("make, via_file", [
    (lambda: np.arange(N, dtype=np.float64).reshape(512, 512), True),
    (lambda: np.asfortranarray(np.random.rand(512, 512)), True),
    (lambda: np.zeros(MIB, dtype=[("a", "<i4"), ("b", ">f8")])[::1], True),
    (lambda: np.random.rand(1024, 1024)[:, ::2], False),  # not contiguous: ordinary path
    (lambda: np.array([object()] * N), False),             # objects: ordinary path
    (lambda: np.arange(10), False),                        # small
], ids=["C", "F", "structured", "non-contiguous", "object", "small"])
def test_arrays_arrive_equal(make, via_file, big):
    value = make()
    got = roundtrip({"a": value}, big)["a"]
    assert type(got) is np.ndarray and got.dtype == value.dtype and got.shape == value.shape
    if value.dtype.hasobject:
        assert len(got) == len(value)
    else:
        assert np.array_equal(got, value)
        assert got.flags.f_contiguous == value.flags.f_contiguous and got.flags.writeable
    assert bool(files(big)) is via_file


def test_read_only_array_stays_read_only_and_same_object_arrives_once(big):
    value = np.zeros(MIB)
    value.flags.writeable = False
    got = roundtrip({"a": value, "b": value}, big)
    assert got["a"] is got["b"] and not got["a"].flags.writeable
    assert len(files(big)) == 1


def test_memmap_travels_as_before(big, tmp_path):
    path = tmp_path.parent / f"{tmp_path.name}.mm"
    mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(N,))
    mm[:] = 3.0
    try:
        got = roundtrip({"m": mm}, big)["m"]
        assert np.array_equal(got, mm) and files(big) == []
    finally:
        del mm
        path.unlink()


def test_copy_on_write_in_this_process(big):
    tensor, array = torch.zeros(N), np.zeros(N)
    blob = package.ship({"t": tensor, "a": array}, big=big)
    one, two = package.unship(blob), package.unship(blob)
    one["t"] += 1
    one["a"][:] = 1
    assert float(two["t"].sum()) == 0 and two["a"].sum() == 0
    assert float(tensor.sum()) == 0 and array.sum() == 0
    for name in files(big):
        path = os.path.join(big.directory, name)
        with open(path, "rb") as f:
            assert f.read().count(0) == os.path.getsize(path)
        assert os.stat(path).st_mode & 0o777 == 0o400


RANK = textwrap.dedent("""
    import os, sys
    from taas.job import package
    with open(sys.argv[1], "rb") as f:
        ns = package.unship(f.read())
    t, a = ns["t"], ns["a"]
    maps = open("/proc/self/maps").read().splitlines()
    mine = [line.split()[1] for line in maps if sys.argv[2] + "/taas-" in line]
    print("mapped", sorted(mine), flush=True)
    if sys.stdin.readline().strip() == "write":
        t.add_(5)
        a += 5
    else:
        print("sums", float(t.sum()), float(a.sum()), flush=True)
    print("done", flush=True)
""")


def test_copy_on_write_between_processes(big, tmp_path_factory):
    """Two 'ranks' map the same files; one writes in place; the other, the files and the
    kernel's values are unchanged."""
    tensor, array = torch.ones(N), np.ones(N)
    blob_path = tmp_path_factory.mktemp("blob") / "names.pkl"
    blob_path.write_bytes(package.ship({"t": tensor, "a": array}, big=big))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(blob_path), big.directory], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        for rank in ranks:
            assert rank.stdout.readline().strip() == "mapped ['rw-p', 'rw-p']"  # private mappings
        writer, reader = ranks
        writer.stdin.write("write\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "done"
        reader.stdin.write("read\n")
        reader.stdin.flush()
        assert reader.stdout.readline().split() == ["sums", str(float(N)), str(float(N))]
        assert reader.stdout.readline().strip() == "done"
    finally:
        for rank in ranks:
            rank.stdin.close()
            rank.wait(timeout=60)
    assert [r.returncode for r in ranks] == [0, 0]
    assert float(tensor.sum()) == N and array.sum() == N


def test_inline_without_a_shipment_and_blob_small_with_one(big):
    value = torch.randn(4 * N)
    assert len(package.ship({"x": value})) > 4 * MIB
    assert len(package.ship({"x": value}, big=big)) < 4096


def test_no_room_travels_the_ordinary_way_with_one_note(big, monkeypatch):
    monkeypatch.setattr(bigvalues, "ROOM_MARGIN", 1 << 62)
    value = {"x": torch.randn(N), "y": np.random.rand(N)}
    got = roundtrip(value, big)
    assert torch.equal(got["x"], value["x"]) and np.array_equal(got["y"], value["y"])
    assert files(big) == []
    assert len(big.notes) == 1 and "too little free space" in big.notes[0]


def test_failed_ship_leaves_no_file(big):
    conn = socket.socket()
    try:
        with pytest.raises(PackagingError, match="conn"):
            package.ship({"a": torch.randn(N), "conn": conn}, big=big)
    finally:
        conn.close()
    assert files(big) == [] and big.paths == []


def test_names_carry_the_job_id_for_the_cleanup(big):
    package.ship({"a": torch.randn(N), "b": np.random.rand(N)}, big=big)
    assert files(big) == ["taas-testjob-value0", "taas-testjob-value1"]


def test_with_stand_ins_both_apply(big):
    loader = object()
    got = package.unship(package.ship(
        {"loader": loader, "t": torch.ones(N)}, stand_ins={id(loader): "loader"}, big=big))
    assert isinstance(got["loader"], package.StandIn) and got["loader"].name == "loader"
    assert torch.equal(got["t"], torch.ones(N)) and len(files(big)) == 1


class _LooksAtTheDirectory:
    """Pickled after a big value: records what the directory holds at that moment."""
    seen: list = []

    def __init__(self, directory):
        self.directory = directory

    def __reduce__(self):
        _LooksAtTheDirectory.seen.append(sorted(os.listdir(self.directory)))
        return (str, ("x",))


def test_files_are_unnamed_until_pickling_is_done(big):
    """A kernel killed while it writes the files (seconds for GiBs) must leave nothing."""
    _LooksAtTheDirectory.seen = []
    package.ship({"a": torch.ones(N), "b": _LooksAtTheDirectory(big.directory)}, big=big)
    assert _LooksAtTheDirectory.seen == [[]]
    assert files(big) == ["taas-testjob-value0"]


def test_named_files_where_unnamed_ones_cannot_be_named(big, monkeypatch):
    monkeypatch.setitem(bigvalues._UNNAMED_OK, big.directory, False)
    _LooksAtTheDirectory.seen = []
    got = roundtrip({"a": torch.ones(N), "b": _LooksAtTheDirectory(big.directory)}, big)
    assert _LooksAtTheDirectory.seen == [["taas-testjob-value0"]]
    assert torch.equal(got["a"], torch.ones(N))


def test_unlink_without_waiting_removes_the_files_in_a_thread(big):
    import threading

    package.ship({"a": torch.ones(N)}, big=big)
    big.unlink(wait=False)
    for thread in threading.enumerate():
        if thread.name == "taas-unlink":
            thread.join(timeout=30)
    assert files(big) == [] and big.paths == []


# -- resident storages: moved to shared memory in place, once; passed by descriptor ------------
# Bigger than glibc's largest mmap threshold (32 MiB), so torch's allocation is always a chunk of
# its own mapping, wherever this test runs in a long session.


@pytest.fixture
def resident(monkeypatch):
    """A shipment with the kernel's resident memory, and a 'rank' in this process: the env var
    the launcher sets, listing the passed descriptors (here: the kernel's own duplicates)."""
    memory = ResidentMemory()
    shipment = BigValues("testjob", resident=memory)
    yield shipment, lambda: monkeypatch.setenv(bigvalues.SHARED_FDS_ENV, ",".join(map(str, shipment.fds)))
    shipment.unlink()
    memory.close()


def _mapping_of(address: int) -> resmem.Mapping:
    return next(m for m in resmem.read_maps() if m.start <= address < m.end)


def test_a_storage_moves_to_shared_memory_in_place_and_every_alias_follows(resident):
    R_N = mmapped_floats()
    big, as_rank = resident
    base = torch.randn(R_N)
    view = base[N:2 * N]
    before = base.clone()
    address = base.data_ptr()
    raw = (ctypes.c_float * 4).from_address(address)  # an alias torch knows nothing of
    blob = package.ship({"base": base, "view": view}, big=big)
    assert len(big.fds) == 1 and big.written >= R_N * 4 and big.paths == []
    as_rank()
    got = package.unship(blob)  # at once: the rank waits for the move going on in the background
    assert torch.equal(got["base"], before)
    big.resident.settle()
    assert base.data_ptr() == address and _mapping_of(address).perms == "rw-s"  # same place, shared now
    assert torch.equal(base, before) and view.data_ptr() == base.data_ptr() + N * 4
    base[0] = -5.0  # the notebook keeps using its tensor as before, aliases included
    assert raw[0] == -5.0 and base.untyped_storage().resizable()
    assert got["base"][0].item() == -5.0  # (a page the rank has not written follows the file)
    got["view"][0] = 123.0  # copy-on-write in the rank ...
    assert got["base"][N].item() == 123.0 and base[N].item() == before[N].item()  # ... never the notebook's


def test_a_resident_storage_is_not_copied_again(resident, monkeypatch):
    R_N = mmapped_floats()
    big, as_rank = resident
    base = torch.randn(R_N)
    package.ship({"x": base}, big=big)
    big.unlink()
    again = BigValues("testjob2", resident=big.resident)
    try:
        blob = package.ship({"x": base}, big=again)
        assert again.written == 0 and len(again.fds) == 1  # no copy: the same file, passed again
        monkeypatch.setenv(bigvalues.SHARED_FDS_ENV, ",".join(map(str, again.fds)))
        assert torch.equal(package.unship(blob)["x"], base)
    finally:
        again.unlink()
    assert again.fds == []


def test_a_tensor_with_a_numpy_alias_is_copied_and_the_alias_still_works(resident):
    """torch marks a storage with a numpy alias not resizable; such memory is not moved (the old
    swap-the-pointer design freed it under the array: the kernel crashed)."""
    R_N = mmapped_floats()
    big, as_rank = resident
    base = torch.arange(R_N, dtype=torch.float32)
    alias = base.numpy()
    got = roundtrip({"x": base}, big)
    assert big.resident.moved == 0 and big.fds == [] and len(big.paths) == 1  # a file for this job
    assert torch.equal(got["x"], base)
    torch.zeros(R_N), torch.ones(R_N)  # memory freed and reused meanwhile would show here
    alias[0] = 42.0
    assert base[0].item() == 42.0 and float(alias[1:5].sum()) == 1 + 2 + 3 + 4


def test_memory_torch_does_not_own_is_copied(resident):
    R_N = mmapped_floats()
    big, as_rank = resident
    array = np.arange(R_N, dtype=np.float32)
    got = roundtrip({"x": torch.from_numpy(array)}, big)
    assert big.resident.moved == 0 and big.fds == [] and np.array_equal(got["x"].numpy(), array)


def test_a_freed_tensors_file_is_closed_by_prune(resident):
    R_N = mmapped_floats()
    big, as_rank = resident
    base = torch.randn(R_N)
    package.ship({"x": base}, big=big)
    big.unlink()
    memory = big.resident
    (block,) = memory._blocks.values()
    memory.prune()
    assert len(memory) == 1  # still in use
    del base
    memory.prune()
    assert len(memory) == 0
    with pytest.raises(OSError):
        os.fstat(block.fd)


def test_move_keeps_every_byte_and_maps_the_file_chunk_by_chunk():
    import mmap

    region = mmap.mmap(-1, 5 * resmem.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region[:] = os.urandom(len(region))
    before = bytes(region)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    fd = os.memfd_create("test")
    try:
        resmem.move(fd, start, len(region), chunk=2 * resmem.PAGE, movers=2)
        assert bytes(region) == before and os.pread(fd, len(region), 0) == before
        maps = resmem.read_maps()
        assert resmem._covered(maps, start, start + len(region), lambda m: m.perms == "rw-s")
        region[0:4] = b"abcd"  # the region is the file now
        assert os.pread(fd, 4, 0) == b"abcd"
    finally:
        os.close(fd)


def test_a_failed_move_leaves_the_memory_as_it_was():
    import mmap

    region = mmap.mmap(-1, 4 * resmem.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region[:] = os.urandom(len(region))
    before = bytes(region)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    fd = os.open("/dev/null", os.O_RDONLY)  # every write fails
    try:
        with pytest.raises(OSError):
            resmem.move(fd, start, len(region), chunk=resmem.PAGE)
    finally:
        os.close(fd)
    assert bytes(region) == before
    assert resmem._anonymous(resmem.read_maps(), start, len(region))


def test_a_process_waits_for_a_complete_file_and_fails_on_a_failed_move(tmp_path):
    import threading

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"x" * 100, 0)
        writer = threading.Timer(0.05, lambda: os.pwrite(fd, resmem.DONE, 100))
        writer.start()
        resmem.wait_moved(fd, 100)  # returns once the byte past the end is written
        writer.join()
        os.ftruncate(fd, 100)
        os.pwrite(fd, resmem.FAILED, 100)
        with pytest.raises(OSError, match="could not move a big tensor"):
            resmem.wait_moved(fd, 100)
    finally:
        os.close(fd)


def test_only_a_chunk_of_its_own_mapping_qualifies():
    Mapping = resmem.Mapping
    anon = [Mapping(0x10000, 0x90000, "rw-p", 0, (0, 0), 0)]
    assert resmem._anonymous(anon, 0x10000, 0x80000)
    assert not resmem._anonymous(anon, 0x10000, 0x90000 + 0x1000)  # beyond the mapping
    split = [Mapping(0x10000, 0x20000, "rw-p", 0, (0, 0), 0), Mapping(0x20000, 0x30000, "rw-s", 0, (0, 5), 9)]
    assert not resmem._anonymous(split, 0x10000, 0x20000 + 0x1000)  # half moved already
    block = resmem.Block(0x20000, 0x10000, -1, (0, 5), 9)
    assert resmem._backed_by(split, block)
    assert not resmem._backed_by(split, resmem.Block(0x20000, 0x10000, -1, (0, 5), 10))  # another file
    data = bytearray(8 << 20)  # a buffer Python allocated: its pointer is not a glibc chunk of ours
    address = ctypes.addressof(ctypes.c_char.from_buffer(data))
    got = resmem.allocation(address + 4096 - address % 4096, 1 << 20, resmem.read_maps())
    assert got is None


def test_for_a_cluster_no_named_file_is_written_and_values_arrive_inline(tmp_path):
    """A job on a cluster: files in this machine's /dev/shm would not reach other nodes, so
    arrays (and storages not sent by descriptor) are pickled inline, without a note."""
    shipment = BigValues("testjob", directory=str(tmp_path), files=False)
    try:
        array, tensor = np.arange(N, dtype=np.float64), torch.arange(N, dtype=torch.float32)
        got = roundtrip({"a": array, "t": tensor}, shipment)
        assert np.array_equal(got["a"], array) and torch.equal(got["t"], tensor)
        assert os.listdir(tmp_path) == [] and shipment.notes == [] and shipment.written == 0
    finally:
        shipment.unlink()


def test_a_ctrl_c_as_the_results_channel_opens_leaves_it_to_close_fds(monkeypatch, python_sigint):
    """The channel is made and held as one step: an interrupt between the two orphaned it, its
    thread and four descriptors living as long as the kernel."""
    import signal

    made = bigvalues.ResultChannel

    def interrupted():
        channel = made()
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the channel is made
        return channel

    monkeypatch.setattr(bigvalues, "ResultChannel", interrupted)
    before = set(os.listdir("/proc/self/fd"))
    big = BigValues("job-interrupted")
    with pytest.raises(KeyboardInterrupt):
        big.open_results_channel()
    big.close_fds()
    assert set(os.listdir("/proc/self/fd")) == before
