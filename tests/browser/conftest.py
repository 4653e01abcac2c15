"""One JupyterLab server and one headless browser for the whole session, a notebook (one kernel)
per test module, and a screenshot of the page at the end of every test.

Screenshots go to $TAAS_SCREENSHOTS, else tests/browser/screenshots/ (git-ignored), one PNG per
test named after it (and <test>-<label>.png for the moments a test snaps mid-way, ``snap``);
they are written whether the test passed or failed, and never removed.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.support.jupyterlab import Browser, JupyterLab, Notebook, missing_requirements
from tests.support.paths import REPO_ROOT

SCREENSHOTS = os.environ.get("TAAS_SCREENSHOTS") or os.path.join(os.path.dirname(__file__), "screenshots")


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    server = JupyterLab(str(tmp_path_factory.mktemp("lab"))).start()
    yield server
    left = server.stop()
    assert left == [], f"processes under JupyterLab outlived it (killed): {left}"


@pytest.fixture(scope="session")
def browser(lab, tmp_path_factory):
    b = Browser(str(tmp_path_factory.mktemp("chromium"))).start()
    try:
        b.open_lab(lab)
    except Exception:
        b.quit()
        raise
    yield b
    left = b.quit()
    assert left == [], f"browser processes outlived quit (killed): {left}"


@pytest.fixture(scope="module")
def notebook(request, browser, lab):
    """A notebook of its own for the module (named after it), its kernel with taas loaded."""
    name = request.module.__name__.rsplit(".", 1)[-1] + ".ipynb"
    nb = Notebook(browser, lab, name).open()
    done = nb.run_done("%load_ext taas\nimport taas\nprint(taas.__file__)")
    # The kernel runs this checkout's taas (the kernelspec puts it first on PYTHONPATH).
    assert [o["text"].strip() for o in done["outputs"]] == [os.path.join(REPO_ROOT, "taas", "__init__.py")], done
    yield nb
    nb.close()


def _shot_name(request, label: str = "") -> str:
    name = re.sub(r"[^\w.-]+", "_", request.node.name)
    return os.path.join(SCREENSHOTS, f"{name}{'-' + label if label else ''}.png")


@pytest.fixture
def snap(request, notebook, browser):
    """``snap(label)``: a screenshot now, cell ``notebook.last`` in view, as <test name>-<label>.png
    (a moment the end-of-test screenshot cannot show: a panel while the job runs)."""
    def take(label: str) -> str:
        notebook.show(notebook.last)
        path = _shot_name(request, label)
        browser.screenshot(path)
        return path
    return take


@pytest.fixture(autouse=True)
def screenshot(request, notebook, browser):
    """The page as the test left it, its last cell in view: <test name>.png."""
    yield
    if notebook.last >= 0:
        notebook.show(notebook.last)
    browser.screenshot(_shot_name(request))
