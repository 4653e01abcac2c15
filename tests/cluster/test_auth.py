"""taas on a cluster with Ray's token authentication (the simulated cluster runs with
``RAY_AUTH_MODE=token``, see tests/support/cluster.py): a client with the token connects and taas
writes no token file of its own; a client without it gets one line that says what to do (through
Ray Client too, where Ray cannot tell a refused token from an unreachable server)."""

import json
import os
import stat
import sys

import pytest

from tests.support.kernel_driver import cell
from tests.support.paths import with_repo_on_path

pytestmark = pytest.mark.cluster

# Connects as ``%taas cluster ADDRESS`` does; prints what happened as one JSON line.
CONNECT = """
import json, os
from taas.errors import LaunchError
from taas.session import Session
try:
    lines = Session().use_cluster({address!r})
    out = {{"lines": lines}}
except LaunchError as e:
    out = {{"error": str(e)}}
print("RESULT " + json.dumps(out))
"""


def connect(cluster, tmp_path, auth: bool, address: str | None = None) -> dict:
    home = tmp_path / "home"
    home.mkdir()
    env = with_repo_on_path(dict(os.environ, HOME=str(home)))
    run = cluster.run([sys.executable, "-c", cell(CONNECT.format(address=address or cluster.address))],
                      cwd=tmp_path, auth=auth, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout + run.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    out["home"] = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    return out


def test_the_token_file_is_readable_by_its_owner_only(ray_cluster):
    path = ray_cluster.auth_env["RAY_AUTH_TOKEN_PATH"]
    assert ray_cluster.auth_env["RAY_AUTH_MODE"] == "token"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_client_with_the_token_connects_and_taas_writes_no_token_file(ray_cluster, tmp_path):
    out = connect(ray_cluster, tmp_path, auth=True)
    assert "error" not in out, out["error"]
    assert any("GPU" in line for line in out["lines"]), out["lines"]
    assert not [p for p in out["home"] if "auth_token" in p], out["home"]


def test_a_client_without_the_token_gets_one_line_saying_what_to_do(ray_cluster, tmp_path):
    out = connect(ray_cluster, tmp_path, auth=False)
    assert "error" in out, out
    message = out["error"]
    assert "\n" not in message, message
    assert "token" in message and "RAY_AUTH_MODE=token" in message, message
    assert not [p for p in out["home"] if "auth_token" in p], out["home"]


def test_a_ray_client_kernel_without_the_token_gets_one_line_saying_what_to_do(ray_cluster, tmp_path):
    """Ray Client retries the refused token until its connect timeout (about 30 s), then says
    only "ray client connection timeout": taas's line names both causes and the GCS address."""
    out = connect(ray_cluster, tmp_path, auth=False, address=ray_cluster.client_address)
    assert "error" in out, out
    message = out["error"]
    assert "\n" not in message, message
    assert message.startswith(f"cannot connect to the Ray cluster at '{ray_cluster.client_address}': "
                              "its Ray Client server did not answer"), message
    assert "RAY_AUTH_MODE=token" in message and "HOST:6379" in message, message
