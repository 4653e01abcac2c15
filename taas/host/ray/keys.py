"""Where a Ray job record lives in the cluster's key-value store (pure: names in, names out).

Every key of a job is ``jobs/<owner>/<id>/<part>`` in the KV namespace :data:`NAMESPACE`, where
``owner`` is ``<user>.<uid>`` of the OS user who started it: ``%taas jobs`` lists only the
caller's own prefix, and an id is looked up only there, so another user's jobs are never listed,
read, attached to or cancelled by these calls.  The job host is the actor
``taas-job-<owner>-<id>`` in the same Ray namespace, or a kernel's warm spare
``taas-spare-<owner>-<token>`` that took the job: the job's ``host`` part names it.
"""

from __future__ import annotations

import getpass
import os
import re

NAMESPACE = "taas"
RECORD = "record"
VIEW = "view"
SECRET = "secret"  # the per-job token the host's cancel() checks
HOST = "host"  # the name of the actor that hosts the job (absent: actor_name(owner, id))
DOOR = "door"  # ip:port where a kept job's host lets kernels adopt its ranks (taas.host.ray.door)
_OWNER = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ID = re.compile(r"^[0-9a-f]{6,32}$")


def owner() -> str:
    """This OS user as records name them: ``user.uid``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "uid"
    user = re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:48] or "uid"
    return f"{user}.{os.getuid()}"


def prefix(who: str) -> str:
    """Every key of ``who``'s jobs starts with this."""
    if not _OWNER.match(who):
        raise ValueError(f"not an owner: {who!r}")
    return f"jobs/{who}/"


def key(who: str, job_id: str, part: str) -> str:
    if not _ID.match(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return f"{prefix(who)}{job_id}/{part}"


def split(who: str, name: str) -> tuple[str, str] | None:
    """(job id, part) of a key of ``who``'s, None for any other key."""
    start = prefix(who)
    if not name.startswith(start):
        return None
    job_id, _, part = name[len(start):].partition("/")
    if not _ID.match(job_id) or not part:
        return None
    return job_id, part


def actor_name(who: str, job_id: str) -> str:
    return f"taas-job-{who}-{job_id}"


def spare_name(who: str, token: str) -> str:
    """A warm job host a kernel keeps ready for its next detached cell (taas.host.ray.spares)."""
    if not _OWNER.match(who) or not _ID.match(token):
        raise ValueError(f"not a spare: {who!r}, {token!r}")
    return f"taas-spare-{who}-{token}"


def chunk(part: str, seq: int, nbytes: int) -> str:
    """A log chunk's part name: its order and its size (``taas jobs`` sums sizes from names)."""
    return f"{part}/{seq:010d}-{nbytes}"


def chunk_of(part: str, name: str) -> tuple[int, int] | None:
    """(seq, nbytes) of a chunk part of log ``part``, None for anything else."""
    match = re.fullmatch(re.escape(part) + r"/(\d{10})-(\d+)", name)
    return (int(match.group(1)), int(match.group(2))) if match else None
