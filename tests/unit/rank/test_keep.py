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
