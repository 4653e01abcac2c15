"""The notebook's working directory on cluster nodes that do not share the kernel's filesystem,
through a real kernel.  The simulated cluster's nodes all share this machine's filesystem, so
the kernel asks for what a cluster without shared storage gets: ``%taas cluster ADDRESS
--workdir copy`` (each node keeps its own copy; taas.workdir.sync)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.support.cluster_helpers import connected_kernel
from tests.support.kernel_driver import cell

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]


@pytest.fixture(scope="module")
def kernel(ray_cluster, tmp_path_factory):
    k = connected_kernel(ray_cluster, tmp_path_factory.mktemp("notebook"), options="--workdir copy")
    assert "copied to every node" in k.connected.stdout, k.connected.stdout
    yield k
    k.run("%taas cluster local")
    k.shutdown()


WHERE = """
%%taas --gpus 4
import json, os, torch
with open("data.txt") as f:
    seen = f.read()
print("WHERE", json.dumps([int(os.environ["RANK"]), os.environ["TAAS_NODE_ID"], os.getcwd(), seen]), flush=True)
if os.environ["RANK"] == "0":
    torch.save({"w": torch.arange(3)}, "model.pt")
if os.environ["RANK"] in ("1", "2"):  # ranks > 0 write their private layer: merged back
    with open(f"from_rank{os.environ['RANK']}.txt", "w") as f:
        f.write("r" + os.environ["RANK"])
"""


def where(run) -> dict[int, list]:
    return {row[0]: row[1:] for row in (json.loads(m) for m in re.findall(r"WHERE (.*)", run.stdout))}


def test_ranks_read_a_copy_and_rank_zeros_file_comes_back(kernel):
    made = kernel.run("open('data.txt', 'w').write('hello 42')")
    assert made.error is None, made.traceback
    run = kernel.run(cell(WHERE))
    assert run.error is None, run.traceback + run.stderr
    rows = where(run)
    assert sorted(rows) == [0, 1, 2, 3], run.stdout + run.stderr
    assert all(seen == "hello 42" for _, _, seen in rows.values()), rows
    nodes = [rows[r][0] for r in range(4)]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    cwds = [rows[r][1] for r in range(4)]
    notebook = os.path.realpath(kernel.workdir)
    assert all(os.path.realpath(c) != notebook for c in cwds), cwds  # a copy, not the notebook's
    assert cwds[0] == cwds[1] != cwds[2] == cwds[3], cwds  # one copy per node
    assert all(os.path.basename(c) == os.path.basename(notebook) for c in cwds), cwds

    after = kernel.run(cell("""
        import os, torch
        print(torch.load("model.pt")["w"].tolist(), open("from_rank1.txt").read(), open("from_rank2.txt").read())
        """))
    assert after.error is None, after.traceback
    assert after.stdout.strip() == "[0, 1, 2] r1 r2", after.stdout

    # A warm cell: the node that lacks model.pt gets it, and the copies stay where they were.
    again = kernel.run(cell("""
        %%taas --gpus 4
        import json, os, torch
        print("AGAIN", json.dumps([int(os.environ["RANK"]), os.getcwd(),
                                   torch.load("model.pt")["w"].tolist()]), flush=True)
        """))
    assert again.error is None, again.traceback + again.stderr
    rows2 = {r: (c, w) for r, c, w in (json.loads(m) for m in re.findall(r"AGAIN (.*)", again.stdout))}
    assert sorted(rows2) == [0, 1, 2, 3], again.stdout
    assert all(w == [0, 1, 2] for _, w in rows2.values()), rows2
    assert [rows2[r][0] for r in range(4)] == cwds


def test_an_oversized_working_directory_is_one_line(kernel, ray_cluster):
    made = kernel.run("open('big.bin', 'wb').write(b'\\0' * (3 << 20))")
    assert made.error is None, made.traceback
    try:
        assert kernel.run(f"%taas cluster {ray_cluster.address} --workdir-limit 1M").error is None
        run = kernel.run("%%taas --gpus 2\nprint('ran')")
        assert run.status == "error"  # IPython shows a UsageError as one line on stderr
        usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError")]
        assert len(usage) == 1, run.stderr
        assert "3.0 MiB" in usage[0] and "over the limit of 1.0 MiB" in usage[0], usage
        assert "--workdir-limit" in usage[0], usage
        assert "ran" not in run.stdout
    finally:
        kernel.run("import os\nos.remove('big.bin')")
        kernel.run(f"%taas cluster {ray_cluster.address} --workdir-limit 1G")
    assert kernel.run("%%taas --gpus 2\nprint('fine')").error is None


def test_the_copies_are_gone_when_the_kernel_is(ray_cluster, tmp_path):
    """The kernel killed: Ray ends its agents, and each agent's guard removes its copy."""
    k = connected_kernel(ray_cluster, tmp_path, options="--workdir copy")
    try:
        assert k.run("open('data.txt', 'w').write('x')").error is None
        run = k.run(cell(WHERE))
        assert run.error is None, run.traceback + run.stderr
        copies = {os.path.dirname(c) for _, c, _ in where(run).values()}
        assert len(copies) == 2 and all(os.path.isdir(c) for c in copies), copies
    finally:
        k.shutdown()  # kills the kernel: its Ray connection ends, and its agents with it
    deadline = time.monotonic() + 120
    while any(os.path.exists(c) for c in copies) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(c) for c in copies), copies


def test_auto_uses_the_notebooks_directory_where_nodes_share_it(kernel, ray_cluster):
    assert kernel.run(f"%taas cluster {ray_cluster.address} --workdir auto").error is None
    try:
        run = kernel.run(cell(WHERE))
        assert run.error is None, run.traceback + run.stderr
        cwds = {os.path.realpath(c) for _, c, _ in where(run).values()}
        assert cwds == {os.path.realpath(kernel.workdir)}, cwds
        assert not [n for n in os.listdir(kernel.workdir) if n.startswith(".taas-where-")]
    finally:
        kernel.run(f"%taas cluster {ray_cluster.address} --workdir copy")
