"""A real front end for tests: JupyterLab 4 on 127.0.0.1 and headless Chromium driving it.

- :class:`JupyterLab`: a Lab server (from its own venv, see tools/install-browser.sh) on a free
  loopback port with a random token, in a temp root, with a kernelspec ``taas-test`` for this
  venv's python that runs taas from this checkout.  Its settings turn off windowed notebooks
  (every cell stays in the DOM) and every fetch from the internet (news, update checks).
- :class:`Browser`: Debian's chromium through its own chromedriver, both by path, so selenium
  never runs selenium-manager and nothing downloads a browser.
- :class:`Notebook`: one notebook in that browser, driven through ``window.jupyterapp`` (Lab's
  ``--expose-app-in-browser``): add a cell, run it with ``notebook:run-cell``, read its outputs
  and prompt from the DOM, click the toolbar's interrupt button.

Everything waits for a DOM or server condition with a generous bound; nothing sleeps a fixed
time.  Every process started here ends by pid when its owner stops (:func:`end_processes`).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request

import psutil

from tests.support import processes
from tests.support.paths import REPO_ROOT

# The page is asked less often than a process table: each look is a round trip to the browser.
wait_for = functools.partial(processes.wait_for, poll=0.2)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KERNEL_NAME = "taas-test"
INSTALL = "bash tools/install-browser.sh"
# Bounds for "until it is there": only a real hang reaches them on a busy 2-core machine.
START_TIMEOUT = 180.0
CELL_TIMEOUT = 300.0

# Lab's user settings for the tests: every cell rendered (no windowing, so outputs of cells
# scrolled away stay readable), no news or update fetches, no notification toasts over cells.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}


def lab_executable() -> str | None:
    """``jupyter-lab`` of the front end's venv ($TAAS_LAB_VENV, else .venv-lab in this checkout),
    else one beside this python, else None."""
    venv = os.environ.get("TAAS_LAB_VENV") or os.path.join(REPO_ROOT, ".venv-lab")
    for candidate in (os.path.join(venv, "bin", "jupyter-lab"),
                      os.path.join(os.path.dirname(sys.executable), "jupyter-lab")):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def missing_requirements() -> str | None:
    """Why the browser tests cannot run here (one line naming what to install), or None."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if lab_executable() is None:
        missing.append("JupyterLab (.venv-lab)")
    hints = [f"`{INSTALL}`"] if missing else []
    try:
        import selenium  # noqa: F401  (only whether it is there)
    except ImportError:
        missing.append("selenium")
        hints.append("`pip install -e '.[test]'`")
    if missing:
        return f"no front end: {', '.join(missing)} missing; install with {' and '.join(hints)}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_processes(procs: list[psutil.Process], timeout: float = 10.0) -> list[str]:
    """Wait up to ``timeout`` for ``procs`` to end, then SIGKILL the rest (each by pid).
    Returns a description of each one that had to be killed (empty: all ended by themselves)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    left = []
    for proc in alive:
        try:
            left.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.Error:  # ended meanwhile
            pass
    psutil.wait_procs(alive, timeout=5)
    return left


class JupyterLab:
    """One Lab server; ``url`` and ``token`` once :meth:`start` returns."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.root = os.path.join(tmp, "root")  # the notebooks and the kernels' working directory
        self.token = secrets.token_hex(24)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(tmp, "lab.log")

    def _install_kernelspec(self) -> str:
        """A kernelspec for this venv's python in ``<tmp>/kernels/share/jupyter``; the kernel
        imports taas from this checkout and stays offline."""
        prefix = os.path.join(self.tmp, "kernels")
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", prefix, "--name", KERNEL_NAME,
                        "--display-name", "taas (tests)"], check=True, capture_output=True)
        spec_file = os.path.join(prefix, "share", "jupyter", "kernels", KERNEL_NAME, "kernel.json")
        with open(spec_file) as f:
            spec = json.load(f)
        # Detached jobs' records in the temp folder; no job host started ahead of a --detach
        # (as in tests/support/kernel_driver.py).
        spec["env"] = {"PYTHONPATH": REPO_ROOT, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                       "TAAS_HOME": os.path.join(self.tmp, "taas-home"), "TAAS_WARM_HOST": "0"}
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        return os.path.join(prefix, "share", "jupyter")

    def _write_settings(self) -> str:
        settings = os.path.join(self.tmp, "settings")
        for name, values in SETTINGS.items():
            path = os.path.join(settings, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(values, f)
        return settings

    def start(self) -> JupyterLab:
        os.makedirs(self.root, exist_ok=True)
        jupyter_path = self._install_kernelspec()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHON"))}
        # Lab's own dirs in the temp folder: no state from or for other runs.
        env.update(JUPYTER_PATH=jupyter_path, JUPYTER_CONFIG_DIR=os.path.join(self.tmp, "config"),
                   JUPYTER_DATA_DIR=os.path.join(self.tmp, "data"),
                   JUPYTER_RUNTIME_DIR=os.path.join(self.tmp, "runtime"))
        argv = [lab_executable(), "--no-browser", "--expose-app-in-browser",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                f"--LabApp.user_settings_dir={self._write_settings()}",
                f"--LabApp.workspaces_dir={os.path.join(self.tmp, 'workspaces')}",
                # Nothing asks the internet: no update checks, no PyPI extension listing.
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly"]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        with open(self.log_path, "wb") as log:
            # Its own session: the server and the kernels it starts are ours to end, by pid.
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(self._ready, START_TIMEOUT, "JupyterLab answering on its port")
        except Exception:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited ({self.proc.returncode}): {self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> list[str]:
        """End the server (it shuts its kernels down) and every process under it; the ones
        that did not end within 10 s by themselves (killed then), described."""
        if self.proc is None:
            return []
        server = psutil.Process(self.proc.pid)
        try:
            procs = [server, *server.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None
        return end_processes(procs)


class Browser:
    """Headless Chromium with a throwaway profile, through Debian's chromedriver."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.driver = None
        self._procs: list[psutil.Process] = []

    def start(self) -> Browser:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--no-first-run", "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--window-size=1400,1000", f"--user-data-dir={self.tmp}/profile"):
            options.add_argument(flag)
        # The driver by path: selenium then skips selenium-manager (which could download one).
        service = Service(executable_path=CHROMEDRIVER, log_output=os.path.join(self.tmp, "chromedriver.log"))
        self.driver = webdriver.Chrome(service=service, options=options)
        driver_proc = psutil.Process(service.process.pid)
        self._procs = [driver_proc, *driver_proc.children(recursive=True)]
        return self

    def open_lab(self, lab: JupyterLab) -> None:
        self.driver.get(f"{lab.url}/lab?token={lab.token}")
        wait_for(lambda: self.driver.execute_script(
            "return !!(window.jupyterapp && document.querySelector('#jp-main-dock-panel'))"),
            START_TIMEOUT, "JupyterLab's app in the page")
        self.driver.execute_async_script(
            "const done = arguments[arguments.length - 1]; window.jupyterapp.restored.then(() => done(true));")

    def screenshot(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.driver.save_screenshot(path)

    def quit(self) -> list[str]:
        """End the browser and its driver; what had to be killed, described."""
        # Chromium starts renderers as pages load: what runs now, besides what ran at start.
        for proc in list(self._procs[:1]):
            try:
                self._procs += [p for p in proc.children(recursive=True) if p not in self._procs]
            except psutil.Error:  # the driver already ended
                pass
        if self.driver is not None:
            try:
                self.driver.quit()
            finally:
                self.driver = None
        return end_processes(self._procs)


# The notebook a Notebook drives is window.__taasNotebooks[name] in the page.
_OPEN = """
const [path, done] = [arguments[0], arguments[arguments.length - 1]];
const app = window.jupyterapp;
app.commands.execute('docmanager:open', {path, factory: 'Notebook'}).then(async (w) => {
  await w.context.ready;
  await w.sessionContext.ready;
  window.__taasNotebooks = window.__taasNotebooks || {};
  window.__taasNotebooks[path] = w;
  app.shell.activateById(w.id);
  done(w.id);
}).catch((e) => done('error: ' + e));
"""

# Append a code cell with the given source (or fill Lab's first empty one), make it the only
# selected cell, run it.
_RUN = """
const [path, source] = arguments;
const app = window.jupyterapp, w = window.__taasNotebooks[path], nb = w.content;
app.shell.activateById(w.id);
const cells = nb.model.cells, last = cells.length ? cells.get(cells.length - 1) : null;
if (last && last.type === 'code' && last.sharedModel.getSource() === '' && last.executionCount === null) {
  last.sharedModel.setSource(source);  // the empty cell Lab gives a new notebook: use it
} else {
  nb.model.sharedModel.insertCell(cells.length, {cell_type: 'code', source});
}
nb.activeCellIndex = cells.length - 1;
nb.deselectAll();
nb.mode = 'command';
app.commands.execute('notebook:run-cell');
return nb.activeCellIndex;
"""

# The cell's prompt ("[*]:", "[3]:") and each output's MIME type, text and images, from the DOM.
_READ = """
const [path, index] = arguments;
const node = window.__taasNotebooks[path].content.widgets[index].node;
const prompt = node.querySelector('.jp-InputArea-prompt');
const outputs = [...node.querySelectorAll('.jp-OutputArea-output')].map((o) => ({
  mime: o.getAttribute('data-mime-type') || '',
  text: o.textContent,
  images: [...o.querySelectorAll('img')].map((i) => ({src: i.src.slice(0, 30), loaded: i.complete,
                                                        width: i.naturalWidth, height: i.naturalHeight})),
}));
return {prompt: prompt ? prompt.textContent.trim() : '', outputs};
"""


class Notebook:
    """A notebook file in Lab's root, opened in the browser with the ``taas-test`` kernel."""

    def __init__(self, browser: Browser, lab: JupyterLab, name: str):
        self.driver = browser.driver
        self.lab = lab
        self.path = name
        self.last = -1  # index of the cell run last
        nb = {"cells": [], "nbformat": 4, "nbformat_minor": 5,
              "metadata": {"kernelspec": {"name": KERNEL_NAME, "display_name": "taas (tests)",
                                          "language": "python"}}}
        with open(os.path.join(lab.root, name), "w") as f:
            json.dump(nb, f)

    def open(self) -> Notebook:
        opened = self.driver.execute_async_script(_OPEN, self.path)
        assert not str(opened).startswith("error"), opened
        self.wait_for_kernel("idle")
        return self

    def kernel_status(self) -> str:
        return self.driver.execute_script(
            "const k = window.__taasNotebooks[arguments[0]].sessionContext.session?.kernel;"
            "return k ? k.status : 'none';", self.path)

    def wait_for_kernel(self, status: str, timeout: float = START_TIMEOUT) -> None:
        wait_for(lambda: self.kernel_status() == status, timeout, f"kernel {status}")

    def run(self, source: str) -> int:
        """Append a cell with ``source`` and start it (without waiting); its index."""
        self.last = self.driver.execute_script(_RUN, self.path, source)
        return self.last

    def read(self, index: int) -> dict:
        """``{"prompt": "[*]:", "outputs": [{"mime", "text", "images"}]}`` of cell ``index``."""
        return self.driver.execute_script(_READ, self.path, index)

    def text(self, index: int) -> str:
        return "\n".join(o["text"] for o in self.read(index)["outputs"])

    def running(self, index: int) -> bool:
        return self.read(index)["prompt"] == "[*]:"

    def wait_done(self, index: int, timeout: float = CELL_TIMEOUT) -> dict:
        """What :meth:`read` gives once the cell's prompt shows its execution count."""
        return wait_for(lambda: (r := self.read(index)) and re.fullmatch(r"\[\d+\]:", r["prompt"]) and r,
                        timeout, f"cell {index} finishing")

    def wait_for_text(self, index: int, pattern: str, timeout: float = CELL_TIMEOUT) -> re.Match:
        return wait_for(lambda: re.search(pattern, self.text(index)), timeout,
                        f"{pattern!r} in cell {index}'s output")

    def run_done(self, source: str, timeout: float = CELL_TIMEOUT) -> dict:
        return self.wait_done(self.run(source), timeout)

    def wait_for_image(self, index: int, timeout: float = 60.0) -> dict:
        """The first image in cell ``index``'s outputs once the browser has decoded it."""
        def loaded():
            images = [i for o in self.read(index)["outputs"] for i in o["images"]]
            return next((i for i in images if i["loaded"] and i["width"] > 0), None)
        return wait_for(loaded, timeout, f"an image rendered in cell {index}")

    def input_box(self, index: int, timeout: float = CELL_TIMEOUT):
        """Cell ``index``'s open input box (a kernel's input request: ``input()``, pdb), as a
        WebElement to type into, once the page shows one and has focused it, as it does for a
        new request; with its prompt's text."""
        found = wait_for(lambda: self.driver.execute_script(
            "const node = window.__taasNotebooks[arguments[0]].content.widgets[arguments[1]].node;"
            "const open = [...node.querySelectorAll('.jp-Stdin')].filter(s => {"
            "  const box = s.querySelector('.jp-Stdin-input');"
            "  return box && !box.disabled && !box.readOnly && box.offsetParent !== null"
            "         && document.activeElement === box; });"
            "if (!open.length) return null;"
            "const last = open[open.length - 1];"
            "const prompt = last.querySelector('.jp-Stdin-prompt');"
            "return [last.querySelector('.jp-Stdin-input'), prompt ? prompt.textContent : ''];",
            self.path, index),
            timeout, f"an input box in cell {index}")
        return found[0], found[1]

    def interrupt_button(self):
        """The interrupt button of this notebook's toolbar, as a WebElement to click."""
        return self.driver.execute_script(
            "return window.__taasNotebooks[arguments[0]].toolbar.node.querySelector("
            "'[data-command=\"notebook:interrupt-kernel\"]');", self.path)

    def show(self, index: int) -> None:
        """Scroll cell ``index`` into view (its end: where its newest output is)."""
        self.driver.execute_script(
            "window.__taasNotebooks[arguments[0]].content.widgets[arguments[1]].node"
            ".scrollIntoView({block: 'end'});", self.path, index)

    def save(self) -> None:
        saved = self.driver.execute_async_script(
            "const [path, done] = [arguments[0], arguments[arguments.length - 1]];"
            "window.__taasNotebooks[path].context.save().then(() => done(true)).catch((e) => done('error: ' + e));",
            self.path)
        assert saved is True, saved

    def reload(self, browser: Browser) -> None:
        """Save, reload the page (a tab closed and opened again) and open this notebook again:
        Lab connects it to the same kernel, which may be busy."""
        self.save()
        self.driver.refresh()
        browser.open_lab(self.lab)
        opened = self.driver.execute_async_script(_OPEN, self.path)
        assert not str(opened).startswith("error"), opened
        wait_for(lambda: self.kernel_status() in ("idle", "busy"), START_TIMEOUT, "the kernel connected")

    def cells(self) -> int:
        return self.driver.execute_script(
            "return window.__taasNotebooks[arguments[0]].content.model.cells.length;", self.path)

    def close(self) -> None:
        """Shut the notebook's kernel down and close it (waiting for the kernel to go)."""
        self.driver.execute_async_script(
            "const [path, done] = [arguments[0], arguments[arguments.length - 1]];"
            "const w = window.__taasNotebooks[path];"
            "w.sessionContext.shutdown().then(() => { w.dispose(); delete window.__taasNotebooks[path];"
            " done(true); }).catch((e) => done('error: ' + e));", self.path)

