"""nbval over examples/: the notebooks that need a Ray cluster are skipped here.

``pytest --nbval examples`` starts each notebook's kernel on this machine, where no cluster is
reachable.  tests/cluster/test_example_kernel.py runs them instead, in a kernel inside the
simulated cluster (tests/support/cluster.py), and compares their outputs the way nbval does.  Their
cells are skipped rather than left uncollected, so the report says where they are checked.
"""

import pathlib

import pytest

CLUSTER_NOTEBOOKS = {"cluster.ipynb"}

_SKIP = pytest.mark.skip(reason="needs a Ray cluster: checked by tests/cluster/test_example_kernel.py "
                                "inside the simulated cluster")


def pytest_collection_modifyitems(items):
    here = pathlib.Path(__file__).resolve().parent
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        if path.parent == here and path.name in CLUSTER_NOTEBOOKS:
            item.add_marker(_SKIP)
