"""How a process tells the kernel how it ended: files in the job directory.

Errors travel through files, as torch elastic's ``@record`` does: a process that fails writes
``<key>.error.json`` before it exits, with the time of failure (the earliest one is the root
cause), the exception chain and its frames.  Frames inside taas itself are dropped, so a user
sees their own code.  A rank that calls ``sys.exit`` writes one whatever the code (0 included:
``exit_code`` 0 is no failure, but says when and where it left).  Rank 0's results go to
``result.pkl`` (:func:`write_result`; their format is :mod:`taas.job.results`, which this
module does not need to know).

A process killed by a signal writes nothing; faulthandler's dump (``<key>.fault``) then shows
where its Python code was.
"""

from __future__ import annotations

import errno
import json
import linecache
import os
import time
import traceback

from taas.launch import api

_TAAS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # taas/


def error_path(job_dir: str, key: str) -> str:
    return os.path.join(job_dir, api.error_name(key))


def fault_path(job_dir: str, key: str) -> str:
    return os.path.join(job_dir, api.fault_name(key))


def result_path(job_dir: str) -> str:
    return os.path.join(job_dir, api.RESULT)


def write_result(job_dir: str, data: bytes) -> None:
    """Rank 0's encoded results, whole or not at all: the kernel never reads half a file."""
    tmp = result_path(job_dir) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, result_path(job_dir))


def _internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_TAAS_DIR + os.sep)


def describe_exception(exc: BaseException) -> list[dict]:
    """The exception chain, outermost last (as Python prints it), as JSON-able dicts."""
    chain: list[dict] = []
    te: traceback.TracebackException | None = traceback.TracebackException.from_exception(exc)
    relation = None
    while te is not None:
        frames = [
            {
                "filename": f.filename,
                "lineno": f.lineno,
                "name": f.name,
                "line": f.line or linecache.getline(f.filename, f.lineno or 0).strip(),
            }
            for f in te.stack
            if not _internal(f.filename)
        ]
        chain.append(
            {
                "type": te.exc_type.__qualname__ if te.exc_type else "Exception",
                "module": te.exc_type.__module__ if te.exc_type else "builtins",
                # exactly the closing line(s) Python prints: "ValueError: bad"
                "text": "".join(te.format_exception_only()).rstrip("\n"),
                "frames": frames,
                "relation": relation,
            }
        )
        if te.__cause__ is not None:
            te, relation = te.__cause__, "cause"
        elif te.__context__ is not None and not te.__suppress_context__:
            te, relation = te.__context__, "context"
        else:
            te = None
    chain.reverse()
    return chain


def storage_hint(exc: BaseException | None) -> str | None:
    """One line of advice when ``exc`` (or an exception it came from) is this process being
    refused a write under the working directory by the read-only rule (EROFS), else None."""
    mode = os.environ.get("TAAS_STORAGE")
    if mode != "strict":
        return None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.EROFS and _in_cwd(exc.filename):
            break
        exc = exc.__cause__ or exc.__context__
    else:
        return None
    if os.environ.get("TAAS_STORAGE_WARNING"):  # --storage layer was asked for and refused
        return ("taas: the working directory is read-only for ranks other than 0 here (this "
                "machine refused --storage layer, see the warning above): write from rank 0, to "
                "this rank's scratch directory ($TAAS_SCRATCH), or use --storage shared if the "
                "ranks never write the same files")
    return ("taas: the working directory is read-only for ranks other than 0 under --storage "
            "strict: write from rank 0, to this rank's scratch directory ($TAAS_SCRATCH), or "
            "use --storage layer")


def _in_cwd(filename) -> bool:
    if filename is None:
        return True  # a write without a name (os.write): EROFS here is the rule's
    try:
        path = os.path.realpath(os.fsdecode(filename))
        cwd = os.path.realpath(os.getcwd())
    except (OSError, TypeError, ValueError):
        return False
    return path == cwd or path.startswith(cwd.rstrip(os.sep) + os.sep)


def write_error(job_dir: str, key: str, exc: BaseException | None, exit_code: int, message: str = "") -> None:
    record = {
        "key": key,
        "time": time.time(),
        "exit_code": exit_code,
        "message": message,
        "chain": describe_exception(exc) if exc is not None else [],
        "hint": storage_hint(exc),
    }
    tmp = error_path(job_dir, key) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, error_path(job_dir, key))


def read_error(job_dir: str, key: str) -> dict | None:
    try:
        with open(error_path(job_dir, key)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
