"""The lease decisions as data: "GPUs seen, leases held, requests waiting" -> take or wait,
and the lines that say so (taas.leases.decide); the GPUs CUDA_VISIBLE_DEVICES leaves
(taas.leases.inventory.visible)."""

from __future__ import annotations

import pytest

from taas.leases.api import Gpu, Holder, Take, Ticket, Wait
from taas.leases.decide import busy_note, decide, gpu_lines, refusal, wait_line
from taas.leases.inventory import fake, visible

GPUS = [Gpu("GPU-a", 0), Gpu("GPU-b", 1), Gpu("GPU-c", 2), Gpu("GPU-d", 3)]
ALICE = Holder("job1", "alice", 0.0, "train.ipynb", 11)
BOB = Holder("job2", "bob", 0.0, "", 12)


def ticket(name: str, count: int = 1, holder: Holder = BOB) -> Ticket:
    return Ticket(name, count, holder)


CASES = {
    # name: (gpus, held, queue, me, count, expected)
    "all free: the lowest indices": (GPUS, {}, [], "5", 2, Take(("GPU-a", "GPU-b"))),
    "held ones skipped": (GPUS, {"GPU-a": ALICE, "GPU-c": ALICE}, [], "5", 2, Take(("GPU-b", "GPU-d"))),
    "index, not list order": ([GPUS[2], GPUS[0]], {}, [], "5", 1, Take(("GPU-a",))),
    "busy outside skipped": ([Gpu("GPU-a", 0, 7000), GPUS[1]], {}, [], "5", 1, Take(("GPU-b",))),
    "leased and using memory is leased, not busy": (
        [Gpu("GPU-a", 0, 7000), GPUS[1]], {"GPU-a": ALICE}, [], "5", 1, Take(("GPU-b",))),
    "all or nothing": (GPUS, {"GPU-a": ALICE, "GPU-b": ALICE}, [], "5", 3,
                       Wait(1, 2, ((GPUS[0], ALICE), (GPUS[1], ALICE)), (), 0)),
    "first come, first served: one ahead": (GPUS, {}, [ticket("3", 4), ticket("5", 1)], "5", 1,
                                           Wait(2, 4, (), (), 1)),
    "those behind do not count": (GPUS, {}, [ticket("5", 1), ticket("7", 4)], "5", 1, Take(("GPU-a",))),
    "not in line yet (--no-wait) is last": (GPUS, {}, [ticket("3", 1)], "~", 1, Wait(2, 4, (), (), 1)),
    "busy and held, shown": ([Gpu("GPU-a", 0, 5000), GPUS[1]], {"GPU-b": BOB}, [], "5", 1,
                             Wait(1, 0, ((GPUS[1], BOB),), (Gpu("GPU-a", 0, 5000),), 0)),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_decide(case):
    gpus, held, queue, me, count, expected = case
    assert decide(gpus, held, queue, me, count, busy_mib=1024) == expected


def test_no_request_ever_takes_a_held_or_busy_gpu_nor_part_of_what_it_asked():
    import itertools

    gpus = [Gpu("GPU-a", 0), Gpu("GPU-b", 1, 2048), Gpu("GPU-c", 2), Gpu("GPU-d", 3)]
    for held_set in itertools.chain.from_iterable(itertools.combinations("abcd", k) for k in range(5)):
        held = {f"GPU-{x}": ALICE for x in held_set}
        for count in range(1, 5):
            d = decide(gpus, held, [], "5", count, busy_mib=1024)
            if isinstance(d, Take):
                assert len(d.uuids) == count
                assert not set(d.uuids) & set(held) and "GPU-b" not in d.uuids
            else:
                assert d.free < count


def test_the_wait_line_names_holders_busy_gpus_and_the_place_in_line():
    wait = Wait(2, 1, ((GPUS[0], ALICE),), (Gpu("GPU-b", 1, 7885),), 1)
    line = wait_line(2, wait)
    assert line.startswith("taas: waiting for 2 GPU(s), 1 free: GPU 0 leased by job job1 (alice, since ")
    assert "train.ipynb)" in line and "GPU 1 busy outside taas (7.7 GiB used)" in line
    assert "; 2nd in line, 1 ahead (interrupt to stop waiting)" in line
    assert "\n" not in line
    no = refusal(2, wait)
    assert no.startswith("--no-wait: 2 GPU(s) asked, 1 free: GPU 0 leased by job job1")
    assert no.endswith("1 job(s) already waiting; nothing was started") and "\n" not in no


@pytest.mark.parametrize("n, text", [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"),
                                     (12, "12th"), (21, "21st"), (112, "112th")])
def test_places_in_line_read_as_english(n, text):
    assert f"; {text} in line" in wait_line(1, Wait(n, 0, (), (), n - 1))


def test_the_machine_lines_show_free_leased_busy_and_leases_not_visible_here():
    gpus = [Gpu("GPU-a", 0), Gpu("GPU-b", 1, 4096), Gpu("GPU-c", 2)]
    lines = gpu_lines(gpus, {"GPU-c": ALICE, "GPU-z": BOB}, busy_mib=1024)
    assert lines[0] == "  GPU 0 GPU-a: free"
    assert lines[1] == "  GPU 1 GPU-b: busy outside taas (4.0 GiB used)"
    assert lines[2].startswith("  GPU 2 GPU-c: leased by job job1 (alice, since ")
    assert lines[3].startswith("  GPU-z (not visible here): leased by job job2 (bob, ")
    assert "GPU 1 (GPU-b, 4.0 GiB used)" in busy_note([gpus[1]])


MACHINE = [Gpu("GPU-11aa", 0, 5), Gpu("GPU-22bb", 1), Gpu("GPU-33cc", 2), Gpu("GPU-44dd", 3)]
VISIBLE = {
    "unset: all": (None, ["GPU-11aa", "GPU-22bb", "GPU-33cc", "GPU-44dd"]),
    "empty: none": ("", []),
    "indices, in the spawner's order": ("2,0", ["GPU-33cc", "GPU-11aa"]),
    "UUIDs and prefixes": ("GPU-44dd,GPU-22", ["GPU-44dd", "GPU-22bb"]),
    "stops at the first unknown": ("1,7,2", ["GPU-22bb"]),
    "a number is an index, never a prefix": ("22", []),
    "a repeat stops it too": ("1,1,2", ["GPU-22bb"]),
    "an ambiguous prefix names none": ("GPU-,1", []),
}


@pytest.mark.parametrize("case", list(VISIBLE.values()), ids=list(VISIBLE))
def test_only_the_gpus_cuda_visible_devices_leaves_are_offered_indexed_as_ranks_see_them(case):
    value, uuids = case
    seen = visible(MACHINE, value)
    assert [g.uuid for g in seen] == uuids
    assert [g.index for g in seen] == list(range(len(uuids)))
    if uuids and uuids[-1] == "GPU-11aa":
        assert seen[-1].used_mib == 5  # what NVML measured goes with the GPU


def test_fake_gpus_read_as_data():
    assert fake("GPU-x, GPU-y:2048,") == [Gpu("GPU-x", 0), Gpu("GPU-y", 1, 2048)]


def test_a_damaged_record_is_an_unknown_holder():
    for data in (None, [], {"job": 5, "since": "x", "pid": "y"}, {"user": "z" * 500}):
        holder = Holder.from_dict(data)
        assert holder.job == "?" and len(holder.user) <= 64
    assert Holder.from_dict(ALICE.as_dict()) == ALICE
