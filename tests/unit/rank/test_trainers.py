"""taas.rank.trainers: the Trainer classes are patched when their module is imported (not
before, and once), and each Trainer built afterwards gets taas's callback.  The libraries are
stood in for by a module written here (importing transformers or Lightning takes seconds);
the real ones are driven in tests/kernel/test_metrics_kernel.py."""

from __future__ import annotations

import sys

import pytest

from taas.rank import trainers

SOURCE = '''
class Trainer:
    def __init__(self, name):
        self.name = name
        self.callbacks = []

    def add_callback(self, callback):
        self.callbacks.append(callback)
'''


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """A package ``taasfake`` whose ``taasfake.trainer`` defines a Trainer, as a patch target."""
    package = tmp_path / "taasfake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "trainer.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(trainers, "TARGETS", {"taasfake.trainer": "fake"})
    monkeypatch.setattr(trainers, "_lightning_callback",
                        lambda trainer, log, module: trainer.add_callback(("taas", log)))
    yield
    for finder in [f for f in sys.meta_path if isinstance(f, trainers._Finder)]:
        sys.meta_path.remove(finder)
    for name in ("taasfake", "taasfake.trainer"):
        sys.modules.pop(name, None)


def test_a_trainer_imported_later_is_patched_when_its_module_loads(fake_library):
    def log(step, values):
        return None

    trainers.install(log)
    assert "taasfake.trainer" not in sys.modules  # nothing imported ahead
    from taasfake.trainer import Trainer

    trainer = Trainer("t")
    assert trainer.name == "t" and trainer.callbacks == [("taas", log)]
    trainers.install(log)  # again (a second cell): one finder, one patch
    assert sum(isinstance(f, trainers._Finder) for f in sys.meta_path) == 1
    assert Trainer("u").callbacks == [("taas", log)]
    module = sys.modules["taasfake.trainer"]
    assert module.__spec__.loader.get_source("taasfake.trainer") == SOURCE  # the loader's other calls pass through


def test_a_trainer_imported_before_is_patched_at_once(fake_library):
    import taasfake.trainer

    trainers.install(print)
    assert taasfake.trainer.Trainer("v").callbacks == [("taas", print)]


def test_a_callback_that_cannot_be_added_costs_one_line_not_the_trainer(fake_library, monkeypatch, capsys):
    def refuse(trainer, log, module):
        raise AttributeError("no callbacks here")

    monkeypatch.setattr(trainers, "_lightning_callback", refuse)
    trainers.install(print)
    from taasfake.trainer import Trainer

    assert Trainer("w").name == "w"
    assert "taas: Trainer's metrics are not drawn (AttributeError: no callbacks here)" in capsys.readouterr().err
