"""The host's Sink: every call the supervisor makes to show something, recorded for viewers.

Lines (``write``), a progress bar's last state (``progress`` with ``final``), rank 0's
``display()`` calls go into the output log as records (:mod:`taas.jobs.log`); what is updated in
place (open progress bars, the rank panel, the live plot) goes into ``view.json``, its latest
state only, at most every :data:`VIEW_EVERY` seconds; metrics rows (``m``: rank, rows) go into
a log of their own, so a notebook that attaches has every row since the start.

Record ops: ``w`` (stream, text), ``p`` (key, stream, text: a finished bar), ``d`` (data,
metadata), ``l`` (name, data, metadata: a live display's last frame), ``P`` (data, metadata:
the rank panel's last state, the summary it gives way to).
"""

from __future__ import annotations

import pathlib
import threading
import time

from taas.jobs.log import LogWriter, write_view

VIEW_EVERY = 0.25


class RecordSink:
    updates_in_place = True  # viewers update the panel and the plot in place (or print them as text)

    def __init__(self, folder: pathlib.Path | None, log: LogWriter, metrics_log: LogWriter, save_view=None):
        # ``save_view(view)``: where the view goes (default: view.json in ``folder``; a job host
        # on a Ray cluster keeps it in the cluster's key-value store, taas.host.ray).
        self.folder = pathlib.Path(folder) if folder is not None else None
        self._save_view = save_view or (lambda view: write_view(self.folder, view))
        self.log = log
        self.metrics_log = metrics_log
        self._lock = threading.Lock()
        self._view: dict = {"progress": {}, "panel": None, "live": {}}
        self._dirty = False
        self._written = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flusher, name="taas-view", daemon=True)
        self._thread.start()

    # -- the Sink protocol -------------------------------------------------------------------
    def write(self, stream: str, text: str) -> None:
        self.log.append({"op": "w", "s": stream, "x": text})

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        with self._lock:
            if final:
                self._view["progress"].pop(f"{key}\n{stream}", None)
            else:
                self._view["progress"][f"{key}\n{stream}"] = text
            self._dirty = True
        if final:
            self.log.append({"op": "p", "k": key, "s": stream, "x": text})

    def display(self, data: dict, metadata: dict) -> None:
        self.log.append({"op": "d", "data": data, "md": metadata})

    def live(self, name: str, data: dict, metadata: dict, final: bool) -> None:
        with self._lock:
            if final:
                self._view["live"].pop(name, None)
            else:
                self._view["live"][name] = {"data": data, "md": metadata}
            self._dirty = True
        if final:
            self.log.append({"op": "l", "n": name, "data": data, "md": metadata})

    def panel(self, bundle: dict, metadata: dict, final: bool) -> None:
        with self._lock:
            self._view["panel"] = None if final else {"data": bundle, "md": metadata}
            self._dirty = True
        if final:  # what the panel gives way to (a summary line): shown by every viewer
            self.log.append({"op": "P", "data": bundle, "md": metadata})

    # -- metrics (taas.job.metrics.HISTORY's observer) ---------------------------------------
    def metrics(self, job_id: str, rank: int, rows) -> None:
        self.metrics_log.append({"op": "m", "r": rank, "rows": [[step, values] for step, values in rows]})

    # ------------------------------------------------------------------------------------------
    def _flusher(self) -> None:
        while not self._stop.wait(VIEW_EVERY):
            self.flush()
        self.metrics_log.close()

    def flush(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            view, self._dirty = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._view.items()}, False
            # How many log records this state follows: a viewer that has read a bar's final
            # record past that knows this view's state of the bar is older (taas.host.client).
            count = self.log.count
        self._save_view(dict(view, at=time.time(), n=count))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._view = {"progress": {}, "panel": None, "live": {}}
            self._dirty = True
        self.flush()
        self.metrics_log.close()
