"""taas.launch.process.report: how a process's end travels to the kernel, as files."""

from __future__ import annotations

import errno
import inspect
import json
import os
import traceback

import pytest

import taas
from taas import directive
from taas.launch import api
from taas.launch.process import report

TAAS_DIR = os.path.dirname(os.path.abspath(taas.__file__))


def raised(fn):
    """The exception ``fn()`` raises."""
    try:
        fn()
    except BaseException as exc:  # whatever it is, the test wants it
        return exc
    raise AssertionError("did not raise")


def user_code():
    directive.parse_options("--gpus many")  # taas raises, deep inside its own frames


def test_an_exception_written_reads_back_with_taas_frames_dropped(tmp_path):
    exc = raised(user_code)
    report.write_error(str(tmp_path), "rank1", exc, exit_code=1)
    record = report.read_error(str(tmp_path), "rank1")
    assert record["key"] == "rank1" and record["exit_code"] == 1 and record["message"] == ""
    (only,) = record["chain"]
    assert only["type"] == type(exc).__qualname__ and only["module"] == type(exc).__module__
    assert only["text"] == "".join(traceback.format_exception_only(exc)).rstrip("\n")  # as Python prints it
    names = [f["name"] for f in only["frames"]]
    assert names == ["raised", "user_code"], only["frames"]  # the user's frames, none of taas's
    assert not any(f["filename"].startswith(TAAS_DIR + os.sep) for f in only["frames"])
    assert only["frames"][-1]["line"] == inspect.getsource(user_code).splitlines()[1].strip()  # its source line
    assert only["frames"][-1]["filename"] == __file__
    assert record["hint"] is None


def test_the_chain_reads_outermost_last_with_its_relations(tmp_path):
    def chained():
        try:
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("second")  # noqa: B904 (the implicit context is what is tested)
        except ValueError as e:
            raise RuntimeError("third") from e  # explicit: cause

    report.write_error(str(tmp_path), "rank0", raised(chained), exit_code=1)
    chain = report.read_error(str(tmp_path), "rank0")["chain"]
    assert [c["text"] for c in chain] == ["KeyError: 'first'", "ValueError: second", "RuntimeError: third"]
    # Each one's relation to the one after it: "first" was being handled when "second" was
    # raised (context), "second" is the cause of "third", which ended the process (None).
    assert [c["relation"] for c in chain] == ["context", "cause", None]


def test_exit_codes_are_kept_with_or_without_an_exception(tmp_path):
    report.write_error(str(tmp_path), "rank0", None, exit_code=0, message="sys.exit(0)")
    report.write_error(str(tmp_path), "rank2", None, exit_code=3, message="sys.exit(3)")
    left, failed = report.read_error(str(tmp_path), "rank0"), report.read_error(str(tmp_path), "rank2")
    assert (left["exit_code"], left["message"], left["chain"]) == (0, "sys.exit(0)", [])
    assert (failed["exit_code"], failed["message"]) == (3, "sys.exit(3)")
    assert failed["time"] >= left["time"]  # the time of failure: the earliest is the root cause


def test_the_record_is_where_the_contract_names_it_and_written_whole(tmp_path):
    report.write_error(str(tmp_path), "rank5", None, exit_code=7)
    assert report.error_path(str(tmp_path), "rank5") == str(tmp_path / api.error_name("rank5"))
    assert os.listdir(tmp_path) == [api.error_name("rank5")]  # no temporary file left beside it
    assert json.loads((tmp_path / api.error_name("rank5")).read_text())["exit_code"] == 7
    assert report.fault_path(str(tmp_path), "rank5") == str(tmp_path / api.fault_name("rank5"))
    assert report.result_path(str(tmp_path)) == str(tmp_path / api.RESULT)


def test_a_missing_or_unreadable_record_is_none(tmp_path):
    assert report.read_error(str(tmp_path), "rank0") is None
    (tmp_path / api.error_name("rank1")).write_text('{"key": "rank1", "exit')  # cut short
    assert report.read_error(str(tmp_path), "rank1") is None


def erofs(path):
    return OSError(errno.EROFS, "Read-only file system", path)


@pytest.fixture
def in_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TAAS_STORAGE_WARNING", raising=False)
    return tmp_path


def test_a_refused_write_under_strict_storage_gets_a_one_line_hint(in_workdir, monkeypatch):
    monkeypatch.setenv("TAAS_STORAGE", "strict")
    hint = report.storage_hint(erofs(str(in_workdir / "model.pt")))
    assert "\n" not in hint and "--storage strict" in hint and "$TAAS_SCRATCH" in hint
    # Found through the exception's cause too, and recorded with the error.
    wrapped = raised(lambda: _reraise(erofs(str(in_workdir / "sub" / "x"))))
    assert report.storage_hint(wrapped) == hint
    report.write_error(str(in_workdir), "rank1", wrapped, exit_code=1)
    assert report.read_error(str(in_workdir), "rank1")["hint"] == hint


def test_the_hint_names_a_refused_layer_when_the_machine_refused_it(in_workdir, monkeypatch):
    monkeypatch.setenv("TAAS_STORAGE", "strict")
    monkeypatch.setenv("TAAS_STORAGE_WARNING", "layer refused")
    hint = report.storage_hint(erofs(None))  # os.write: no file name, the rule's refusal
    assert "\n" not in hint and "refused --storage layer" in hint


def test_no_hint_for_other_errors_modes_or_places(in_workdir, monkeypatch):
    monkeypatch.setenv("TAAS_STORAGE", "strict")
    assert report.storage_hint(None) is None
    assert report.storage_hint(ValueError("x")) is None
    assert report.storage_hint(OSError(errno.EACCES, "denied", str(in_workdir / "f"))) is None
    assert report.storage_hint(erofs("/elsewhere/f")) is None  # not the working directory
    monkeypatch.setenv("TAAS_STORAGE", "layer")
    assert report.storage_hint(erofs(str(in_workdir / "f"))) is None


def _reraise(exc):
    try:
        raise exc
    except OSError as e:
        raise RuntimeError("saving failed") from e
