"""A detached job as a JupyterLab user meets it: the page reloaded mid-job (JupyterLab then
drops what the cell printed meanwhile), ``%taas attach`` shows the output from the first line,
then live, and the job's results land in the notebook.  Screenshots: the attach while the job
still runs (``-attached``), and the end."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.kernel_driver import cell

pytestmark = pytest.mark.browser

TAG = r"\[rank[\d,\-]+\] "


def test_a_reloaded_page_attaches_to_its_detached_job(notebook, browser, lab, snap):
    go = os.path.join(lab.tmp, "detach-go")
    index = notebook.run(cell(f"""
        %%taas --gpus 2 --detach
        import os, time
        print("before the reload", flush=True)
        while not os.path.exists({go!r}):
            time.sleep(0.05)
        print("after the reload", flush=True)
        answer = 6 * 7
        """))
    done = notebook.wait_done(index)
    text = "\n".join(o["text"] for o in done["outputs"])
    job = re.search(r"taas: job ([0-9a-f]{6}) detached: 2 ranks; follow it with %taas attach", text)
    assert job, text
    notebook.reload(browser)
    # The same kernel, and no job output since the cell returned: the job runs outside it.
    attach = notebook.run("%taas attach")  # this notebook's running job (JPY_SESSION_NAME)
    assert attach == notebook.cells() - 1
    notebook.wait_for_text(attach, TAG + "before the reload")
    assert notebook.running(attach) and "after the reload" not in notebook.text(attach)
    snap("attached")
    open(go, "w").close()
    done = notebook.wait_done(attach)
    text = "\n".join(o["text"] for o in done["outputs"])
    assert re.search(TAG + "after the reload", text), text
    assert text.index("before the reload") < text.index("after the reload")
    assert not any(o["mime"] == "application/vnd.jupyter.error" for o in done["outputs"]), text
    check = notebook.run_done("print(answer)")
    assert [o["text"].strip() for o in check["outputs"]] == ["42"], check
