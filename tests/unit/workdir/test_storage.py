"""taas.workdir.storage: the working directory is read-only in a rank > 0, and only there.

Every check runs in a real forked process that calls ``make_read_only`` first thing and
reports through a pipe; the test process itself must see no change at all (no mount leaks
back into its namespace, the directory stays writable).
"""

from __future__ import annotations

import ctypes
import errno
import os
import pickle
import re
import shutil
import subprocess
import tempfile
import traceback

import pytest

from taas.workdir import storage
from taas.workdir.storage import layer_dir, make_read_only, mount_layer, scratch_dir

NOBODY = 65534


# --- helpers ---------------------------------------------------------------------------------


def _mount_points() -> list[str]:
    """Mount points of this process's namespace, unescaped (mountinfo writes ' ' as \\040)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def _mounts_under(path: str) -> list[str]:
    return [p for p in _mount_points() if p == path or p.startswith(path + "/")]


def _in_child(fn, *args):
    """Run ``fn(*args)`` in a forked child; return its result (or raise with its traceback)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            try:
                payload = ("ok", fn(*args))
            except BaseException:
                payload = ("error", traceback.format_exc())
            with os.fdopen(w, "wb") as out:
                pickle.dump(payload, out)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child failed: status {status}"
    kind, value = pickle.loads(data)
    if kind == "error":
        pytest.fail(f"child raised:\n{value}")
    return value


def _try_write(path: str) -> str:
    """'ok' if a file can be created at ``path`` (then removed), else the errno's name."""
    try:
        with open(path, "w") as f:
            f.write("x")
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    os.unlink(path)
    return "ok"


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _rank(root: str, keep: list[str], probes: list[str], drop: bool = False) -> dict:
    """A rank > 0: (optionally become nobody,) make ``root`` read-only, then try writing."""
    if drop:
        _drop_to_nobody()
    reason = make_read_only(root, keep_writable=keep)
    result = {
        "reason": reason,
        "ids": (os.getuid(), os.geteuid(), os.getgid(), os.getegid()),
        "writes": {p: _try_write(p) for p in probes},
    }
    # Children of the rank inherit the rule.
    sh = subprocess.run(["sh", "-c", f"echo x > '{root}/from-a-child'"], capture_output=True)
    result["child_write_rc"] = sh.returncode
    if os.path.exists(f"{root}/from-a-child"):
        os.unlink(f"{root}/from-a-child")
    return result


def _probe_namespaces(drop: bool) -> str | None:
    """What make_read_only needs from the kernel, tried bare: None if allowed, else why not."""
    if drop:
        _drop_to_nobody()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_void_p]
    flags = storage.CLONE_NEWNS if os.geteuid() == 0 else storage.CLONE_NEWUSER | storage.CLONE_NEWNS
    if libc.unshare(flags) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    if libc.mount(None, b"/", None, storage.MS_REC | storage.MS_PRIVATE, None) != 0:
        return f"mount: {os.strerror(ctypes.get_errno())}"
    return None


_probed: dict[bool, str | None] = {}


def _refusal(drop: bool = False) -> str | None:
    if drop not in _probed:
        _probed[drop] = _in_child(_probe_namespaces, drop)
    return _probed[drop]


def _require_namespaces() -> None:
    if _refusal() is not None:
        pytest.skip(f"namespaces refused here: {_refusal()}")


def _expect_enforced(reason: str | None, drop: bool = False) -> None:
    """Enforcement is required wherever the kernel lets a process make the namespaces
    (a bare probe decides, so a bug in make_read_only cannot pass for a kernel refusal);
    elsewhere make_read_only must have returned a one-line reason, and the test is skipped."""
    if reason is None:
        return
    if _refusal(drop) is None:
        pytest.fail(f"the kernel allows the namespaces, yet: {reason}")
    assert isinstance(reason, str) and "\n" not in reason
    assert reason.startswith("cannot make the working directory read-only for ranks > 0 (")
    pytest.skip(f"namespaces refused here ({_refusal(drop)}): {reason}")


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def workdir(monkeypatch):
    """A working directory any user can enter (pytest's tmp_path is 0700 under root's dir),
    with a job directory inside it; the test process runs in it, as a rank would."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="taas-storage-"))
    job = os.path.join(root, "job")
    os.makedirs(job)
    for d in (root, job):
        os.chmod(d, 0o777)
    before = _mounts_under(root)
    monkeypatch.chdir(root)
    yield root
    monkeypatch.undo()
    assert _mounts_under(root) == before == [], "a mount leaked into the test's namespace"
    shutil.rmtree(root)


@pytest.fixture
def outside():
    d = tempfile.mkdtemp(prefix="taas-outside-")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d)


# --- tests -----------------------------------------------------------------------------------


def _check_enforced(result: dict, root: str, outside: str) -> None:
    assert result["reason"] is None
    w = result["writes"]
    assert w["relative.txt"] in ("EROFS", "EACCES")  # through the current directory
    assert w[f"{root}/absolute.txt"] in ("EROFS", "EACCES")
    assert w[f"{root}/job/kept.txt"] == "ok"
    assert w[f"{root}/job/scratch/rank1/kept.txt"] == "ok"
    assert w[f"{outside}/free.txt"] == "ok"
    assert result["child_write_rc"] != 0
    # The parent (rank 0, the kernel, the user) is untouched.
    assert _try_write(f"{root}/parent.txt") == "ok"
    assert _mounts_under(root) == []


def _probes(root: str, outside: str) -> list[str]:
    return ["relative.txt", f"{root}/absolute.txt", f"{root}/job/kept.txt",
            f"{root}/job/scratch/rank1/kept.txt", f"{outside}/free.txt"]


def test_read_only_for_the_rank_writable_elsewhere(workdir, outside):
    root = workdir
    scratch = scratch_dir(os.path.join(root, "job"), 1)
    os.chmod(scratch, 0o777)
    # Paths outside the directory or missing are ignored; "" too.
    keep = [os.path.join(root, "job"), outside, os.path.join(root, "missing"), ""]
    result = _in_child(_rank, root, keep, _probes(root, outside))
    _expect_enforced(result["reason"])
    _check_enforced(result, root, outside)
    ids = os.getuid(), os.geteuid(), os.getgid(), os.getegid()
    assert result["ids"] == ids  # the rank keeps its own uid/gid


def _shared_host(root: str) -> dict:
    """A stand-in for a systemd host whose ``/`` is shared: a namespace of our own, made
    rshared, in which a rank is forked.  Without the rank's make-rprivate step its bind
    mounts would propagate up into this namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_void_p]
    assert libc.unshare(storage.CLONE_NEWNS) == 0, os.strerror(ctypes.get_errno())
    for flags in (storage.MS_REC | storage.MS_PRIVATE, storage.MS_REC | (1 << 20)):  # MS_SHARED
        assert libc.mount(None, b"/", None, flags, None) == 0, os.strerror(ctypes.get_errno())
    with open("/proc/self/mountinfo") as f:
        assert "shared:" in f.read()
    rank = _in_child(_rank, root, [], [f"{root}/absolute.txt"])
    return {"rank": rank, "host_mounts": _mounts_under(root),
            "host_write": _try_write(f"{root}/host.txt")}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a shared mount namespace")
def test_no_propagation_back_to_a_shared_host(workdir):
    _require_namespaces()
    result = _in_child(_shared_host, workdir)
    assert result["rank"]["reason"] is None
    assert result["rank"]["writes"][f"{workdir}/absolute.txt"] == "EROFS"
    assert result["host_mounts"] == []
    assert result["host_write"] == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to nobody; as non-root the first "
                    "test already takes the user-namespace route")
def test_non_root_rank_uses_a_user_namespace(workdir, outside):
    root = workdir
    scratch = scratch_dir(os.path.join(root, "job"), 1)
    os.chmod(scratch, 0o777)
    result = _in_child(_rank, root, [os.path.join(root, "job")], _probes(root, outside), True)
    assert result["ids"] == (NOBODY,) * 4
    if result["reason"] is not None:  # then nothing may be half done
        assert result["writes"][f"{root}/absolute.txt"] == "ok"
    _expect_enforced(result["reason"], drop=True)
    _check_enforced(result, root, outside)


_ST_NOSUID, _ST_NODEV, _ST_NOEXEC = 0x2, 0x4, 0x8


def _rank_on_restricted_mount(root: str, drop: bool) -> dict:
    """The rank's flags probe: the working directory is a nosuid,nodev,noexec mount, whose
    flags are locked in a user namespace (a remount dropping them is EPERM)."""
    if drop:
        _drop_to_nobody()
    reason = make_read_only(root, keep_writable=[os.path.join(root, "job")])
    return {"reason": reason, "flags": os.statvfs(root).f_flag,
            "kept_flags": os.statvfs(os.path.join(root, "job")).f_flag,
            "writes": {p: _try_write(p) for p in (f"{root}/absolute.txt", f"{root}/job/k.txt")}}


def _restricted_host(root: str, drop: bool) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_void_p]
    assert libc.unshare(storage.CLONE_NEWNS) == 0, os.strerror(ctypes.get_errno())
    assert libc.mount(None, b"/", None, storage.MS_REC | storage.MS_PRIVATE, None) == 0
    flags = storage.MS_NOSUID | storage.MS_NODEV | storage.MS_NOEXEC
    assert libc.mount(b"tmpfs", root.encode(), b"tmpfs", flags, b"mode=0777") == 0, \
        os.strerror(ctypes.get_errno())
    os.makedirs(os.path.join(root, "job"))
    os.chmod(os.path.join(root, "job"), 0o777)
    os.chdir(root)
    return _in_child(_rank_on_restricted_mount, root, drop)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
@pytest.mark.parametrize("drop", [False, True], ids=["root", "nobody"])
def test_locked_mount_flags_are_carried_over(workdir, drop):
    _require_namespaces()
    result = _in_child(_restricted_host, workdir, drop)
    _expect_enforced(result["reason"], drop)
    assert result["writes"] == {f"{workdir}/absolute.txt": "EROFS", f"{workdir}/job/k.txt": "ok"}
    for flags in (result["flags"], result["kept_flags"]):  # nothing loosened
        assert flags & (_ST_NOSUID | _ST_NODEV | _ST_NOEXEC) == _ST_NOSUID | _ST_NODEV | _ST_NOEXEC


def _forced_verification_failure(root: str) -> dict:
    storage._verify = lambda path, keep=(): "forced by the test"
    reason = make_read_only(root, keep_writable=[os.path.join(root, "job")])
    return {"reason": reason, "cwd": os.getcwd(),
            "write": _try_write("relative.txt"), "mounts": _mounts_under(root)}


def test_failure_is_a_reason_and_undoes_the_mounts(workdir):
    result = _in_child(_forced_verification_failure, workdir)
    if not result["reason"].endswith("(enforcement failed silently: forced by the test)"):
        _expect_enforced(result["reason"])  # skips where namespaces are refused
    assert result["reason"] == ("cannot make the working directory read-only for ranks > 0 "
                                "(enforcement failed silently: forced by the test)")
    assert result["write"] == "ok"
    assert result["cwd"] == workdir
    assert result["mounts"] == []


def _threaded_rank(root: str) -> dict:
    import threading

    if os.geteuid() == 0:  # root needs no user namespace, and only that needs one thread
        _drop_to_nobody()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        reason = make_read_only(root)
    finally:
        stop.set()
        thread.join()
    return {"reason": reason, "write": _try_write(f"{root}/absolute.txt")}


def test_a_kernel_refusal_is_a_reason(workdir):
    """A real refusal: the kernel gives no multi-threaded process a user namespace."""
    result = _in_child(_threaded_rank, workdir)
    assert result["reason"].startswith("cannot make the working directory read-only for ranks > 0 (")
    assert "unshare: " in result["reason"]
    if _refusal(drop=os.geteuid() == 0) is None:  # refused for the thread, not for the user
        assert "unshare: Invalid argument" in result["reason"]
    assert "\n" not in result["reason"]
    assert result["write"] == "ok"


def test_not_a_directory_is_a_reason(workdir):
    reason = _in_child(make_read_only, os.path.join(workdir, "nope"))
    assert reason.startswith("cannot make the working directory read-only for ranks > 0 (")
    assert "not a directory" in reason


# --- the layer (--storage layer) ---------------------------------------------------------------


def _layered_rank(root: str, layer: str, drop: bool = False) -> dict:
    """A rank > 0 under --storage layer: writes, changes and deletes in ``root``."""
    if drop:
        _drop_to_nobody()
    reason = mount_layer(root, layer)
    result = {"reason": reason, "writes": {}}
    if reason is None:
        with open("new.txt", "w") as f:
            f.write("rank1")
        with open(f"{root}/existing.txt", "w") as f:
            f.write("changed by rank1")
        os.unlink(f"{root}/doomed.txt")
        result["sees"] = sorted(os.listdir(root))
        result["sub"] = _try_write(f"{root}/sub/in-a-mount.txt")
        result["sub_is_mount"] = os.path.ismount(f"{root}/sub")
    return result


def _mounted_sub(root: str) -> dict:
    """The host has a file system mounted inside the working directory (a tmpfs here)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                           ctypes.c_ulong, ctypes.c_void_p]
    assert libc.unshare(storage.CLONE_NEWNS) == 0
    assert libc.mount(None, b"/", None, storage.MS_REC | storage.MS_PRIVATE, None) == 0
    assert libc.mount(b"tmpfs", f"{root}/sub".encode(), b"tmpfs", 0, b"mode=0777") == 0
    rank = _in_child(_layered_rank, root, layer_dir(root + "-job", "rank1"))
    return {"rank": rank, "sub_files": os.listdir(f"{root}/sub")}


@pytest.fixture
def layered(workdir):
    """The working directory with two files from before the job, a job directory outside it."""
    for name in ("existing.txt", "doomed.txt"):
        with open(os.path.join(workdir, name), "w") as f:
            f.write("before")
    os.makedirs(os.path.join(workdir, "sub"))
    job = workdir + "-job"
    os.makedirs(job)
    os.chmod(job, 0o777)
    yield workdir, job
    shutil.rmtree(job, ignore_errors=True)


def _expect_layer(result: dict) -> None:
    if result["reason"] is not None:
        if _refusal() is None and "overlay mount" not in result["reason"]:
            pytest.fail(f"the kernel allows the namespaces, yet: {result['reason']}")
        assert "\n" not in result["reason"]
        pytest.skip(f"no layer here: {result['reason']}")


def test_a_layer_takes_the_ranks_writes_and_leaves_the_directory_alone(layered):
    root, job = layered
    layer = layer_dir(job, "rank1")
    result = _in_child(_layered_rank, root, layer)
    _expect_layer(result)
    assert result["sees"] == ["existing.txt", "job", "new.txt", "sub"]  # its own view
    upper = os.path.join(layer, "upper")
    with open(os.path.join(upper, "new.txt")) as f:
        assert f.read() == "rank1"
    with open(os.path.join(upper, "existing.txt")) as f:
        assert f.read() == "changed by rank1"
    assert os.stat(os.path.join(upper, "doomed.txt")).st_rdev == 0  # a whiteout
    # The real directory, as every other process sees it: untouched, no mount left.
    assert sorted(os.listdir(root)) == ["doomed.txt", "existing.txt", "job", "sub"]
    with open(os.path.join(root, "existing.txt")) as f:
        assert f.read() == "before"
    assert _mounts_under(root) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
def test_mounts_inside_the_directory_stay_visible_and_writable_in_a_layer(layered):
    root, _ = layered
    _require_namespaces()
    result = _in_child(_mounted_sub, root)
    _expect_layer(result["rank"])
    assert result["rank"]["sub_is_mount"] and result["rank"]["sub"] == "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to nobody: the user-namespace route")
def test_a_layer_for_a_non_root_rank(layered):
    root, job = layered
    for name in (".", "existing.txt", "doomed.txt", "sub"):  # the user's own files
        os.chown(os.path.join(root, name), NOBODY, NOBODY)
    result = _in_child(_layered_rank, root, layer_dir(job, "rank1"), True)
    _expect_layer(result)
    assert result["sees"] == ["existing.txt", "job", "new.txt", "sub"]
    with open(os.path.join(layer_dir(job, "rank1"), "upper", "existing.txt")) as f:
        assert f.read() == "changed by rank1"


def test_a_layer_inside_the_directory_is_refused_with_a_reason(workdir):
    result = _in_child(mount_layer, workdir, os.path.join(workdir, "job", "layer", "rank1"))
    assert result == ("cannot give ranks > 0 a private layer over the working directory "
                      "(the job directory is inside the working directory)")


def test_layer_dir_is_a_plain_name(tmp_path):
    assert layer_dir("/j", "loader:train:0") == "/j/layer/loader-train-0"


def test_scratch_dir(tmp_path):
    path = scratch_dir(str(tmp_path / "job"), 3)
    assert path == str(tmp_path / "job" / "scratch" / "rank3")
    assert os.path.isdir(path)
    assert scratch_dir(str(tmp_path / "job"), 3) == path  # again: no error
