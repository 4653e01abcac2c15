"""The working directory's copy on cluster nodes that do not share it (taas.workdir.sync),
as data: what is copied, what changed, the size limit, and a round trip kernel -> node -> kernel."""

from __future__ import annotations

import os

import pytest

from taas.errors import LaunchError
from taas.workdir import sync as ws


def write(path, data=b"x", mtime_ns=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("text,size", [("4096", 4096), ("1K", 1024), ("500M", 500 << 20),
                                       ("2G", 2 << 30), ("1.5g", 3 << 29), ("2GiB", 2 << 30),
                                       ("10 MB", 10 << 20)])
def test_sizes(text, size):
    assert ws.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1M", "1X", "lots"])
def test_not_sizes(text):
    with pytest.raises(ValueError):
        ws.parse_size(text)


@pytest.mark.parametrize("rel,is_dir,out", [
    ("data.csv", False, False), ("sub/data.csv", False, False), ("sub", True, False),
    (".git", True, True), ("a/.git", True, True), (".git/config", False, True),
    ("pkg/__pycache__/m.cpython-311.pyc", False, True), (".ipynb_checkpoints", True, True),
    (".taas", True, True), (".taas/conflicts/j/rank1/x", False, True),
    (".taas-clock-abc", False, True), (".taas-where-abc", False, True),
    ("sub/.taas-where-abc", False, False),  # only the kernel's own, at the top
    (".gitignore", False, False), (".env", False, False),
])
def test_what_is_copied(rel, is_dir, out):
    assert ws.skipped(rel, is_dir) is out


def test_scan_lists_files_links_and_directories_but_not_skipped_ones(tmp_path):
    write(tmp_path / "data.csv", b"1,2\n")
    write(tmp_path / "sub" / "deep" / "x.bin", b"\0" * 10)
    write(tmp_path / ".git" / "HEAD", b"ref")
    write(tmp_path / "__pycache__" / "m.pyc", b"c")
    os.symlink("data.csv", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    manifest = ws.scan(str(tmp_path))
    assert sorted(manifest) == ["data.csv", "link", "sub", "sub/deep", "sub/deep/x.bin"]
    assert manifest["data.csv"][:2] == ("f", 4)
    assert manifest["link"][0] == "l" and manifest["sub"][0] == "d"
    assert ws.size_of(manifest) == 14


def test_the_size_limit_is_one_line_with_the_size_the_limit_and_what_to_do(tmp_path):
    write(tmp_path / "big.bin", b"\0" * (3 << 20))
    manifest = ws.scan(str(tmp_path))
    ws.check_size(manifest, 4 << 20, str(tmp_path))  # under: fine
    with pytest.raises(LaunchError) as info:
        ws.check_size(manifest, 1 << 20, str(tmp_path))
    text = str(info.value)
    assert "\n" not in text
    assert "3.0 MiB" in text and "1.0 MiB" in text and str(tmp_path) in text
    assert "--workdir-limit" in text and ws.LIMIT_ENV in text


def test_the_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(ws.LIMIT_ENV, raising=False)
    assert ws.limit_from_env() == 1 << 30
    monkeypatch.setenv(ws.LIMIT_ENV, "2M")
    assert ws.limit_from_env() == 2 << 20
    monkeypatch.setenv(ws.LIMIT_ENV, "much")
    with pytest.raises(LaunchError, match=ws.LIMIT_ENV):
        ws.limit_from_env()


def test_diff():
    old = {"a": ("f", 1, 0o644, 10), "b": ("f", 1, 0o644, 10), "d": ("d", 0, 0o755, 0),
           "d/x": ("f", 2, 0o644, 5)}
    new = {"a": ("f", 1, 0o644, 10), "b": ("f", 2, 0o644, 11), "c": ("l", 1, 0, 3),
           "d": ("d", 0, 0o755, 0)}
    assert ws.diff(old, new) == (["b", "c"], ["d/x"])
    assert ws.diff({}, new)[0] == ["a", "b", "c", "d"]  # parents first
    assert ws.diff({"d": old["d"], "d/x": old["d/x"]}, {})[1] == ["d/x", "d"]  # children first


def test_a_round_trip_kernel_to_node_and_back(tmp_path):
    kernel, node = tmp_path / "notebook", tmp_path / "node"
    write(kernel / "data.csv", b"1,2\n", mtime_ns=1_000_000_123)
    write(kernel / "sub" / "keep.txt", b"keep")
    write(kernel / "gone.txt", b"old")
    os.symlink("data.csv", kernel / "link")
    node.mkdir()
    # Before the job: the node lacks everything; after the update it holds what the kernel has.
    snapshot = ws.scan(str(kernel))
    need, _ = ws.diff({}, snapshot)
    assert ws.apply(str(node), ws.pack(str(kernel), snapshot, need)) == []
    held = ws.scan(str(node))
    assert held == snapshot  # same sizes, modes and mtimes: a warm cell ships nothing
    assert ws.diff(held, ws.scan(str(kernel)))[0] == []
    # The job (rank 0) writes a file, changes one, deletes one.
    write(node / "model.pt", b"weights")
    write(node / "sub" / "keep.txt", b"changed")
    os.unlink(node / "gone.txt")
    now = ws.scan(str(node))
    changed, deleted = ws.diff(held, now)
    assert changed == ["model.pt", "sub/keep.txt"] and deleted == ["gone.txt"]
    assert ws.apply(str(kernel), ws.pack(str(node), now, changed), deleted, keep_if=snapshot) == []
    assert (kernel / "model.pt").read_bytes() == b"weights"
    assert (kernel / "sub" / "keep.txt").read_bytes() == b"changed"
    assert not (kernel / "gone.txt").exists()
    assert ws.scan(str(kernel)) == now  # the next cell ships nothing back to that node


def test_a_deletion_spares_a_file_the_notebook_changed_meanwhile(tmp_path):
    write(tmp_path / "notes.txt", b"v1")
    snapshot = ws.scan(str(tmp_path))
    write(tmp_path / "notes.txt", b"v2 longer")
    assert ws.apply(str(tmp_path), [], ["notes.txt"], keep_if=snapshot) == []
    assert (tmp_path / "notes.txt").read_bytes() == b"v2 longer"


@pytest.mark.parametrize("rel", ["../evil", "/etc/evil", "a/../../evil", "", "a//b"])
def test_an_entry_outside_the_directory_is_refused(tmp_path, rel):
    assert ws.apply(str(tmp_path / "root"), [(rel, "f", 0o644, 0, b"x")]) == [rel]
    assert not (tmp_path / "evil").exists()


def test_read_tree_sends_a_layer_whole(tmp_path):
    write(tmp_path / "upper" / "rng_state_1.pth", b"r1")
    write(tmp_path / "upper" / "logs" / "rank1.txt", b"log")
    entries = ws.read_tree(str(tmp_path / "upper"))
    assert [e[0] for e in entries] == ["logs", "logs/rank1.txt", "rng_state_1.pth"]
    assert ws.apply(str(tmp_path / "copy"), entries) == []
    assert (tmp_path / "copy" / "logs" / "rank1.txt").read_bytes() == b"log"


def test_a_dead_agents_copy_is_removed_by_its_guard(tmp_path, monkeypatch):
    """The start process's guard outlives an agent killed without shutdown: it removes the
    agent's copies (named by the agent's pid), and only those."""
    import tempfile

    from taas.launch.local import guard

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    write(tmp_path / "taas-workdir-4242-abc" / "notebook" / "data.txt")
    write(tmp_path / "taas-workdir-4243-abc" / "notebook" / "data.txt")
    guard.remove_kernel_trash(4242)
    assert sorted(os.listdir(tmp_path)) == ["taas-workdir-4243-abc"]


def test_the_watcher_runs_a_dead_agents_hooks_and_removes_its_copies(tmp_path, monkeypatch):
    """Ray kills an ended agent's children: a detached watcher (taas.launch.ray.node_watch) runs
    the clean-up hooks of the agent's job and removes its copies, once the agent is gone."""
    import subprocess
    import sys

    from taas.launch.ray import node_watch
    from tests.support.kernel_driver import wait_for

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    hook_made = tmp_path / "hook-ran"
    job_dir = tmp_path / "taas-0123456789ab-xyz"
    write(job_dir / "payload.pkl")
    record = f"""
import sys
from taas.launch.ray import node_watch
node_watch.record([("tests.support.launch_targets:touch", ({str(hook_made)!r},))], {str(job_dir)!r})
print("recorded", flush=True)
sys.stdin.read()
"""
    agent = subprocess.Popen([sys.executable, "-c", record], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert agent.stdout.readline().strip() == "recorded"
    write(tmp_path / f"taas-workdir-{agent.pid}-abc" / "notebook" / "data.txt")
    write(tmp_path / "taas-workdir-1-abc" / "notebook" / "data.txt")  # another agent's
    node_watch.start(agent.pid)
    assert (tmp_path / f"taas-workdir-{agent.pid}-abc").exists() and not hook_made.exists()  # alive
    agent.stdin.close()
    agent.wait()
    wait_for(lambda: hook_made.exists() and not (tmp_path / f"taas-workdir-{agent.pid}-abc").exists()
             and not job_dir.exists(), timeout=60, what="the watcher's clean-up")
    assert sorted(os.listdir(tmp_path)) == ["hook-ran", "taas-workdir-1-abc"]
