"""A kept rank's namespace from one cell to the next (taas.rank.keep._merge)."""

from taas.rank.keep import _merge


def test_sent_names_overwrite_kept_ones_and_the_rest_stay():
    kept = {"model": "m", "lr": 1}
    assert _merge(kept, {"lr": 2}) is kept
    assert kept == {"model": "m", "lr": 2}
    assert _merge(kept, {}) is kept


def test_a_sent_function_runs_in_its_globals_with_the_kept_names():
    sent: dict = {}
    exec("def f():\n    return model", sent)
    sent = {"f": sent["f"]}
    g = sent["f"].__globals__
    g["f"] = sent["f"]
    merged = _merge({"model": "kept model"}, g)
    assert merged is g and merged["f"]() == "kept model"


def test_a_ctrl_c_as_a_kept_cell_ends_is_dropped_after_done_and_the_rank_stays(tmp_path, monkeypatch, python_sigint):
    """The kernel interrupts a cell it saw running just as the rank finished it: the rank still
    says done, then serves the next message (before, the interrupt ended the rank, and the
    kept state with it)."""
    import json
    import os
    import pickle
    import signal

    from taas.job.package import Payload, ship
    from taas.launch.process import cells
    from taas.rank import heartbeat, keep

    payload = Payload(source="pass\n", filename="<cell 2>", first_line=1, names=ship({}), bound=(),
                      device="cpu", backend="gloo", pg_timeout=60.0, results=False, results_to_cpu=True)
    (tmp_path / "payload-1.pkl").write_bytes(pickle.dumps(payload))
    read, write = os.pipe()
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write))
    stop = heartbeat.stop

    def interrupted_stop():
        stop()
        signal.raise_signal(signal.SIGINT)  # the kernel's interrupt, as the cell ends

    monkeypatch.setattr(heartbeat, "stop", interrupted_stop)

    class Inbox:
        messages = [cells.NextCell("payload-1.pkl", "result-1.pkl"), cells.Release()]

        def next(self):
            return self.messages.pop(0)

    code = None
    try:
        try:
            code = keep.serve(str(tmp_path), "rank0", 0, Inbox(), {}, lambda p, ns: None, lambda name: None)
        except KeyboardInterrupt:  # the rank would end here
            pass
        os.close(write)
        sent = [json.loads(line) for line in os.read(read, 1 << 16).splitlines()]
    finally:
        os.close(read)
    assert code == 0 and {"kind": "done", "failed": False, "gpu_mem": None} in sent
