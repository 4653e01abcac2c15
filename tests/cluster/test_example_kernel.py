"""examples/cluster.ipynb, run inside the simulated Ray cluster and checked the way nbval checks
the other examples: one test per code cell ("Cell 0", "Cell 1", ... as nbval names them), each
cell's outputs compared with the ones stored in the notebook after the sanitizers of
examples/sanitize.cfg, by nbval's own code (:func:`nbval.plugin.coalesce_streams` and
``IPyNbCell.compare_outputs``), so a failure reads like nbval's.

Why not nbval itself: the notebook's kernel must run inside the cluster's network namespace
(its ports are reachable only there) and be driven over IPC, with the namespace's init pid in
its command line.  nbval starts kernels by kernel-spec name from a fixed ``KernelManager``; a
kernel spec cannot know the pid of a cluster this session started, and nbval would also need a
second cluster of its own.  Here the session's ``ray_cluster`` fixture (one cluster start for
every cluster test) provides the kernel (``ray_cluster.kernel``), with ``RAY_ADDRESS`` set as a
user would set it.  Plain ``pytest --nbval examples`` skips this notebook (examples/conftest.py).

Like nbval: cells run in order in one kernel; a cell that raises fails unless it is tagged
``raises-exception``; a cell stored without an ``execution_count`` is run but not compared;
outputs are compared after coalescing streams, without metadata, tracebacks and images.  Unlike
nbval, a display updated in place (taas's prefetch progress line) counts with its last content,
as Jupyter stores it, and a stream whose whole text the sanitizers remove (a warning only some
runs print) counts as absent.

Regenerate the stored outputs after changing the notebook (needs what the cluster needs: root,
unshare, nsenter, ip, ray)::

    TAAS_REGENERATE_EXAMPLE=1 python -m pytest -q tests/cluster/test_example_kernel.py

runs every cell without comparing and, when all ran, writes their outputs and execution counts
into examples/cluster.ipynb.  Review the diff, and check that what changed between two runs is
covered by a sanitizer.
"""

from __future__ import annotations

import copy
import os
import pathlib
import types

import nbformat
import pytest

from tests.support.kernel_driver import OFFLINE

pytestmark = [pytest.mark.kernel, pytest.mark.cluster]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
NOTEBOOK = EXAMPLES / "cluster.ipynb"
SANITIZE = EXAMPLES / "sanitize.cfg"
REGENERATE = os.environ.get("TAAS_REGENERATE_EXAMPLE") == "1"

# The messages that become a cell's stored outputs (nbval keeps the same four kinds).
_OUTPUT_KINDS = ("stream", "display_data", "execute_result", "error")


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


_CELLS = _code_cells(nbformat.read(NOTEBOOK, as_version=4))


class _Notebook:
    """The kernel running the notebook, and the outputs its cells produced so far."""

    def __init__(self, kernel, nb):
        self.kernel = kernel
        self.nb = nb
        self.ran: dict[int, tuple[list, int | None]] = {}  # cell number -> outputs, count
        self.failed = False


@pytest.fixture(scope="module")
def notebook(ray_cluster, tmp_path_factory):
    # A scratch working directory: nothing the ranks write lands in the repository.
    workdir = tmp_path_factory.mktemp("cluster-notebook")
    kernel = ray_cluster.kernel(str(workdir), load_taas=False,
                                env={**OFFLINE, "RAY_ADDRESS": ray_cluster.address})
    run = _Notebook(kernel, nbformat.read(NOTEBOOK, as_version=4))
    try:
        yield run
    finally:
        # Leave the cluster as found, even after a failure before the notebook's last cell.
        kernel.run("%taas cluster local")
        kernel.shutdown()
    if REGENERATE and not run.failed and len(run.ran) == len(_CELLS):
        for number, cell in enumerate(_code_cells(run.nb)):
            cell.outputs, cell.execution_count = run.ran[number]
        nbformat.write(run.nb, NOTEBOOK)


@pytest.mark.parametrize("number", range(len(_CELLS)), ids=[f"Cell {i}" for i in range(len(_CELLS))])
def test_cell(notebook, number, request):
    cell = _CELLS[number]
    if number > 0 and number - 1 not in notebook.ran:
        pytest.fail("an earlier cell did not run; see its failure")
    run = notebook.kernel.run(cell.source, batch=True)  # as nbval sends it (the panel: taas.io.board)
    outputs = _outputs(run.messages)
    count = next((m["content"]["execution_count"] for m in run.messages
                  if m["msg_type"] == "execute_input"), None)
    notebook.ran[number] = (outputs, count)
    if run.error is not None and "raises-exception" not in cell.metadata.get("tags", []):
        notebook.failed = True
        pytest.fail(f"Cell {number}: cell execution caused an exception\n\nInput:\n{cell.source}\n\n"
                    + "\n".join(run.error["traceback"]), pytrace=False)
    if REGENERATE or cell.execution_count is None:
        return
    comparison = _NbvalComparison(request)
    from nbval.plugin import coalesce_streams

    # coalesce_streams merges texts into its first stream output of each name: copies.
    test = comparison.without_empty_streams(coalesce_streams(outputs))
    ref = comparison.without_empty_streams(coalesce_streams(copy.deepcopy(cell.outputs)))
    if not comparison.compare_outputs(test, ref):
        notebook.failed = True
        pytest.fail(f"Cell {number}: cell outputs differ\n\nInput:\n{cell.source}\n\n"
                    + "\n".join(comparison.comparison_traceback), pytrace=False)


def _outputs(messages: list) -> list:
    """A cell's outputs as Jupyter stores them: consecutive writes to one stream joined, a
    display updated in place (``update_display_data``) holding its last content."""
    outputs, displays = [], {}
    for msg in messages:
        kind, content = msg["msg_type"], msg["content"]
        display_id = content.get("transient", {}).get("display_id")
        if kind == "update_display_data":
            for out in displays.get(display_id, []):
                out.data, out.metadata = content["data"], content["metadata"]
        elif kind in _OUTPUT_KINDS:
            out = nbformat.v4.output_from_msg(msg)
            last = outputs[-1] if outputs else None
            if kind == "stream" and last is not None and last.output_type == "stream" \
                    and last.name == out.name:
                last.text += out.text
                continue
            outputs.append(out)
            if display_id:
                displays.setdefault(display_id, []).append(out)
    return outputs


class _NbvalComparison:
    """What nbval's ``IPyNbCell.compare_outputs`` reads from the pytest item it is a method of,
    so that its comparison (and its failure report) is nbval's, not a copy.  Written against
    nbval 0.11: the attributes are ``parent.skip_compare``, ``parent.sanitize_patterns``,
    ``colors``, ``config`` and ``ihook``."""

    def __init__(self, request):
        from nbval.plugin import IPyNbCell, get_sanitize_patterns, nocolors

        # IPyNbFile's skip_compare without --nbdime.
        skip = ("metadata", "traceback", "prompt_number", "output_type", "name",
                "execution_count", "application/vnd.jupyter.widget-view+json",
                "image/png", "image/jpeg")
        patterns = dict(get_sanitize_patterns(SANITIZE.read_text()))
        self.parent = types.SimpleNamespace(skip_compare=skip, sanitize_patterns=patterns)
        self.colors = nocolors
        self.config = request.config
        self.ihook = request.node.ihook
        self._cell = IPyNbCell

    def without_empty_streams(self, outputs: list) -> list:
        """``outputs`` less the streams whose text the sanitizers remove entirely (a warning
        that only some runs print, alone on its stream): nbval would count the stream itself."""
        return [o for o in outputs if o.output_type != "stream" or self.sanitize(o.text) != ""]

    def compare_outputs(self, test, ref) -> bool:
        return self._cell.compare_outputs(self, test, ref)

    def sanitize(self, s):
        return self._cell.sanitize(self, s)

    def format_output_compare(self, key, left, right):
        return self._cell.format_output_compare(self, key, left, right)
