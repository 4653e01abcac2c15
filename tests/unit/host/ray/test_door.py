"""A kept job's door on a Ray cluster (taas.host.ray.door) between threads over TCP on
127.0.0.1: the host actor's KeptHost served in a thread that is not the main one (as in a Ray
actor), a kernel adopting through the door with the secret from the cluster's records, a wrong
secret refused, release and cancel ending the host, and the door's key gone after."""

from __future__ import annotations

import functools
import threading

import pytest

from taas.host import channel
from taas.host.adopt import Door
from taas.host.api import Hello, Refused, Welcome
from taas.host.kept import KeptHost
from taas.host.ray import door, keys
from taas.host.ray.store import RayStore
from taas.jobs.api import State
from tests.support.jobs import make_record
from tests.support.kept_session import KeptSession
from tests.support.kv import DictKV


def _kept_job(job_id: str):
    store = RayStore(DictKV(), where="ray://test", owner="ada.1000")
    record = make_record(job_id, State.KEPT, keep=True)
    store.create(record)
    store.put(job_id, keys.SECRET, b"ab" * 32)
    host = KeptHost(KeptSession(), store, record, record_sink=None, door=door.TcpDoor(store, job_id, "127.0.0.1"))
    final: dict = {}
    thread = threading.Thread(target=lambda: final.update(record=host.serve()), name="taas-job")
    thread.start()
    return store, host, thread, final


def test_a_kernel_adopts_through_the_door_and_release_ends_the_host():
    store, host, thread, final = _kept_job("a1b2c3")
    try:
        address = store.get("a1b2c3", keys.DOOR).decode()
        assert address.startswith("127.0.0.1:")
        raw, _ = door.knock(store, "a1b2c3")
        channel.send(raw, Hello("0" * 64, 7))
        refused = channel.recv(raw)[0]
        raw.close()
        assert isinstance(refused, Refused) and refused.line == (
            "taas: job a1b2c3 refused the connection: wrong secret")
        adopted = Door(store, "a1b2c3", "train.ipynb", knock=functools.partial(door.knock, store, "a1b2c3"))
        assert adopted.welcome == Welcome("a1b2c3", 2, "cpu", "gloo", "k1", None, 1)
        assert adopted.call("release") is None  # the host ends, saying so
        assert adopted.lost() == "taas: released the kept ranks (2 on cpu/gloo) of job a1b2c3"
    finally:
        host.cancel()  # whatever failed above: the host's thread ends
        thread.join(30)
    assert not thread.is_alive()
    assert final["record"].state is State.DONE
    assert store.get("a1b2c3", keys.DOOR) is None  # nobody knocks at a closed door


def test_a_cancel_ends_a_host_served_in_a_thread_and_its_adopter_is_told():
    store, host, thread, final = _kept_job("d4e5f6")
    adopted = Door(store, "d4e5f6", knock=functools.partial(door.knock, store, "d4e5f6"))
    host.cancel()
    thread.join(30)
    assert not thread.is_alive() and final["record"].state is State.CANCELLED
    assert adopted.lost() == "taas: job d4e5f6 was cancelled: the kept ranks (2 on cpu/gloo) ended"
    adopted.close()
    with pytest.raises(OSError, match="no door"):
        door.knock(store, "d4e5f6")
