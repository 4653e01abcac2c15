"""The IPython adapter: ``%%taas`` / ``%taas``.

Thin on purpose (as ipyparallel's magics are): parse options, hand the cell to
:class:`taas.session.Session`, put results into the notebook.  Everything IPython-specific in
taas lives in this module, :mod:`taas.notebook` (the cell as IPython hands it over: the
``#pragma taas`` transformer, the body's IPython syntax, the display formatter rank 0 uses;
and the NotebookSink) and the extension hook in ``taas/__init__.py``: the layers below get what
they need from the notebook as plain values.
"""

from __future__ import annotations

import logging
import functools
import os
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from taas import directive
from taas.errors import DirectiveError, JobFailed, LaunchError, PackagingError, RegistrationError
from taas.notebook import NotebookSink, no_kernel_post_mortem, cell_number, translate
from taas.session import WARN, Session, TerminalSink, write_note

log = logging.getLogger(__name__)

_BEFORE_LAUNCH = (DirectiveError, PackagingError, RegistrationError, LaunchError)


@magics_class
class TaasMagics(Magics):
    def __init__(self, shell, session: Session):
        super().__init__(shell)
        self.session = session
        from taas.host.spares import Hosts

        self.hosts = Hosts()  # a warm job host for the next --detach (none started yet)
        self.cluster_spares = None  # the same on a Ray cluster, after a first --detach there
        if os.environ.get("TAAS_ATTACHED_IN_HOST", "1") != "0":
            from taas.host.remote import KernelHost

            session.job_host = KernelHost()  # attached jobs run in the kernel's job host child

    def warm(self) -> None:
        """Start a job host ahead of the first ``--detach`` (unless ``TAAS_WARM_HOST=0``), so that
        a detached cell starts as fast as an attached one."""
        from taas.jobs.store import JobError, Store

        if os.environ.get("TAAS_WARM_HOST", "1") != "0":
            try:
                self.hosts.prewarm(Store())
            except JobError:  # a records folder we may not use: said when a cell detaches
                pass

    def close(self) -> None:
        """``%unload_ext``: let the warm job host go (a host with a job goes on; adopted kept
        ranks wait for the next kernel, until their idle limit: Session.close)."""
        self.hosts.close()
        if self.cluster_spares is not None:
            self.cluster_spares.close()

    @line_cell_magic
    def taas(self, line: str, cell: str | None = None):
        if cell is None:
            return self._status(line)
        shell = self.shell
        number = cell_number(shell)
        log.debug("cell In[%s]: %d line(s), options %r", number, len(cell.splitlines()), line.strip())
        try:
            options = directive.parse_options(line)
        except DirectiveError as exc:
            raise UsageError(str(exc)) from None
        log.debug("parsed options: %s", options)
        source = translate(cell)  # IPython syntax in the body (before anything starts)
        # Register the whole cell with IPython so tracebacks say "Cell In[7], line 4".
        filename = shell.compile.cache(f"%%taas {line}\n{cell}", number)
        sink = self._sink()
        if options.detach:
            return self._detach(line, cell, source, options, filename, sink)
        post_mortem = bool(getattr(shell, "call_pdb", False))  # IPython's %pdb on
        try:
            result = self.session.run_cell(
                source, shell.user_ns, options, filename=filename, first_line=2, sink=sink,
                hidden=frozenset(shell.user_ns_hidden), name_for=self._name_for, text=cell,
                post_mortem=post_mortem,
            )
        except _BEFORE_LAUNCH as exc:
            log.debug("refused before launch: %s: %s", type(exc).__name__, exc)
            raise UsageError(str(exc)) from None
        except JobFailed:
            if post_mortem:
                no_kernel_post_mortem(shell)  # the rank's was the post-mortem
            raise
        log.debug("back in the notebook: %s%s", ", ".join(sorted(result.values)) or "no names",
                  ", and Out" if result.has_out else "")
        shell.user_ns.update(result.values)
        for note in result.notes:  # a value that did not come back: a WARN note (taas.io.output)
            write_note(sink, note, WARN)
        return result.out if result.has_out else None

    taas.__doc__ = directive.HELP

    def _sink(self) -> NotebookSink | None:
        kernel = getattr(self.shell, "kernel", None)
        # An interactive front end (JupyterLab, Notebook, VS Code) asks with allow_stdin; batch
        # runners (nbconvert, nbclient, nbval, papermill) do not, and keep only a display's
        # last state: they get the panel as text, and only for long jobs (taas.io.board).
        return NotebookSink(bool(getattr(kernel, "_allow_stdin", False)), kernel) if kernel is not None else None

    # -- jobs that outlive the kernel (--detach; taas.host) ------------------------------------
    def _detach(self, line: str, cell: str, source: str, options, filename: str, sink):
        """``--detach``: the cell's job under a host of its own; this cell shows it until its
        ranks run, then returns with one line naming it.  The same cell of the same notebook
        whose job still runs is attached to instead (``--fresh``: a new job)."""
        from taas.host import client
        from taas.jobs.store import Store

        address = self.session.cluster_address(options)
        launcher = self.session.launcher_for(address) if address is not None else None
        try:
            store = Store() if launcher is None else self._cluster_store(launcher)
        except (*_BEFORE_LAUNCH, client.JobError) as exc:
            raise UsageError(str(exc)) from None
        notebook = os.environ.get("JPY_SESSION_NAME", "")
        whole = f"{line}\n{cell}"
        try:
            copy = client.running_copy(store, whole, notebook) if notebook and not options.fresh else None
            if copy is not None:
                print(f"taas: this cell's job {copy.id} is still running (since "
                      f"{time.strftime('%H:%M', time.localtime(copy.started))}): attaching to it "
                      "(--fresh starts a new one)")
                return self._attach(copy.id, store, launcher=launcher)
            hidden = frozenset(self.shell.user_ns_hidden)
            from taas.host import detach

            if launcher is None:
                record = detach.start_here(self.session, store, source, self.shell.user_ns, options,
                                           filename=filename, text=cell, hidden=hidden, name_for=self._name_for,
                                           notebook=notebook, hashed=whole, sink=sink or TerminalSink(),
                                           hosts=self.hosts)
            else:  # a detached actor on the cluster hosts it (taas.host.ray)
                from taas.host.ray import client as cluster_jobs
                from taas.host.ray.spares import ClusterSpares

                self.cluster_spares = self.cluster_spares or ClusterSpares()
                record = cluster_jobs.start_there(self.session, launcher, store, source, self.shell.user_ns, options,
                                                  filename=filename, text=cell, hidden=hidden,
                                                  name_for=self._name_for, notebook=notebook, hashed=whole,
                                                  sink=sink or TerminalSink(), spares=self.cluster_spares)
        except (*_BEFORE_LAUNCH, client.JobError) as exc:
            raise UsageError(str(exc)) from None
        cluster = f"--cluster {launcher.address} " if launcher is not None else ""
        follow = f"or taas {cluster}attach {record.id} in a terminal"
        print(f"taas: job {record.id} detached: {record.ranks} ranks; follow it with %taas attach {record.id}, "
              f"{follow}")
        return None

    def _records(self):
        """This user's job records where the session's cells run, and their launcher: this
        machine's (None), or the session's cluster's (taas.host.ray: in its key-value store)."""
        from taas.jobs.store import Store

        address = self.session.cluster_address()
        if address is None:
            return Store(), None
        launcher = self.session.launcher_for(address)
        try:
            return self._cluster_store(launcher), launcher
        except _BEFORE_LAUNCH as exc:
            raise UsageError(str(exc)) from None

    @staticmethod
    def _cluster_store(launcher):
        from taas.host.ray import client as cluster_jobs

        return cluster_jobs.store_for(launcher)

    def _land(self, loaded, sink):
        """Rank 0's names into the notebook, their notes, and Out[]."""
        values, out, has_out, notes = loaded
        self.shell.user_ns.update(values)
        for note in notes:
            write_note(sink, note, WARN)
        return out if has_out else None

    def _adopt(self, store, job_id: str, sink, launcher=None):
        """``%taas attach`` on a kept job: its ranks become this notebook's kept ranks (this
        kernel's own kept ranks are released first); then its first cell's results land, once.
        ``launcher``: the cluster's whose host actor keeps them (its door: taas.host.ray.door)."""
        from taas.host import adopt, client

        take = knock = None
        if launcher is not None:
            from taas.host.ray import client as cluster_jobs
            from taas.host.ray import door as doors

            take, knock = cluster_jobs.take, functools.partial(doors.knock, store, job_id)
        door = adopt.Door(store, job_id, os.environ.get("JPY_SESSION_NAME", ""), knock=knock)
        try:
            returned = adopt.first_cell(store, job_id, take)
        except BaseException:  # its failure raised here: the ranks are this notebook's all the same
            self._adopted(door, job_id, sink, {}, launcher)
            raise
        loaded = None if returned is None else client.load(returned)
        self._adopted(door, job_id, sink, loaded[0] if loaded else {}, launcher)
        return None if loaded is None else self._land(loaded, sink)

    def _adopted(self, door, job_id: str, sink, values: dict, launcher) -> None:
        """The adopted ranks are the session's kept ranks now (holding their first cell's names)."""
        local = self.session.adopt(door.kept(launcher or self.session.launcher), values, sink)
        if local:
            write_note(sink, f"{local}: this notebook's kept ranks are job {job_id}'s from now on", WARN)
        print(f"taas: job {job_id}'s kept ranks ({door.describe()}) are this notebook's now: the next "
              "taas cells run on them; %taas release ends them")

    def _attach(self, job_id: str | None, store=None, latest: int | None = None, launcher=None):
        """``%taas attach [ID]``: the job's output so far, then live; at its end rank 0's names
        and Out[] land here, or its failure is raised.  An interrupt detaches."""
        from taas.host import client
        from taas.jobs import listing
        from taas.session import job_metrics

        if store is None:
            store, launcher = self._records()  # launcher: the cluster's whose store it is, or None
        try:
            job_id = store.resolve(job_id) if job_id else listing.default_job(
                store.listing(), os.environ.get("JPY_SESSION_NAME", ""))
            if job_id is None:
                raise UsageError("taas: no running job and no results waiting; `%taas jobs` lists your jobs")
            kept = self.session.kept
            if kept is not None and getattr(getattr(kept, "host", None), "record", "") == job_id \
                    and kept.handle is not None and kept.handle.lost() is None:
                print(f"taas: job {job_id}'s kept ranks are this notebook's already; %taas release ends them")
                return None
            sink = self._sink() or TerminalSink()
            try:
                record = client.follow(store, job_id, sink, latest=client.LATEST if latest is None else latest,
                                       on_metrics=job_metrics.HISTORY.add)
            except KeyboardInterrupt:
                print(f"taas: detached from job {job_id}; it goes on (%taas attach {job_id} follows it again)")
                return None
            if record.state.value == "kept":  # its cell ended; its ranks wait to be adopted
                return self._adopt(store, job_id, sink, launcher)
            # A kept job's first cell ended well even if its ranks were cancelled or lost later.
            if record.state.value != "done" and not (record.keep and record.has_results and record.taken is None):
                client.raise_failure(store, record)
            if launcher is not None:
                from taas.host.ray import client as cluster_jobs

                return self._land(client.load(cluster_jobs.take(store, record)), sink)
            return self._land(client.load(client.take(store, record)), sink)
        except client.JobError as exc:
            raise UsageError(str(exc)) from None

    def _jobs(self, words: list[str]) -> None:
        """``%taas jobs | attach [ID] | cancel ID | forget ID | logs ID``."""
        from taas.host import client
        from taas.jobs import listing

        store, launcher = self._records()
        verb, args = words[0], words[1:]
        try:
            if verb == "jobs" and not args:
                print("\n".join([listing.render(store.listing()), *self.session.gpu_lines()]))
            elif verb == "attach" and len(args) <= 1:
                return self._attach(args[0] if args else None, store, launcher=launcher)
            elif verb == "cancel" and len(args) == 1:
                if launcher is not None:
                    from taas.host.ray import client as cluster_jobs

                    record = cluster_jobs.cancel(launcher, store, store.resolve(args[0]))
                else:
                    record = client.cancel(store, store.resolve(args[0]))
                print(f"taas: job {record.id} {record.state.value}")
            elif verb == "forget" and len(args) == 1:
                job_id = store.resolve(args[0])
                store.remove(job_id)
                print(f"taas: job {job_id} forgotten")
            elif verb == "logs" and len(args) == 1:
                client.Follower(store, store.resolve(args[0]), self._sink() or TerminalSink()).finish()
            else:
                raise UsageError(f"%taas {verb} takes {_JOB_USAGE[verb]}, got {' '.join(words)!r}")
        except client.JobError as exc:
            raise UsageError(str(exc)) from None
        return None

    def _name_for(self, filename: str) -> str | None:
        label = self.shell.compile.format_code_name(filename)
        return f"{label[0]} {label[1]}" if label else None

    def _status(self, line: str):
        """``%taas``: where jobs run, the kept ranks and what the last job did; ``%taas cluster
        ADDRESS|local [--workdir auto|shared|copy] [--workdir-limit SIZE]`` sets where the
        session's cells run; ``%taas release`` ends the kept ranks."""
        from taas import status

        words = line.split()
        try:
            if words and words[0] == "cluster":
                address, settings = _cluster_words(words[1:])
                if self.cluster_spares is not None:  # made for the cluster being left
                    self.cluster_spares.close()
                print("\n".join(self.session.use_cluster(address, **settings)))
                return
            if words and words[0] == "debug":  # %taas debug [RANK] on kept ranks
                return self._debug(words[1:])
            if words == ["release"]:  # end the kept ranks (--keep)
                print(self.session.release(NotebookSink() if getattr(self.shell, "kernel", None)
                                           is not None else None) or "taas: no kept ranks")
                return
            if words and words[0] in _JOB_USAGE:
                return self._jobs(words)
            if words:
                raise UsageError("%taas takes no arguments but 'cluster ADDRESS|local', 'release', "
                                 "'debug [RANK]', 'jobs', 'attach [ID]', 'cancel ID', 'forget ID' or 'logs ID', "
                                 f"got {line.strip()!r}")
            print(status.render(self.session))
        except LaunchError as exc:
            raise UsageError(str(exc)) from None

    def _debug(self, args: list[str]) -> None:
        """``%taas debug [RANK]``: pdb where the kept rank's last failed cell raised."""
        if len(args) > 1 or (args and not args[0].isdigit()):
            raise UsageError(f"%taas debug takes at most a rank number, got {' '.join(args)!r}")
        try:
            self.session.debug(int(args[0]) if args else None, self._sink(), name_for=self._name_for)
        except LaunchError as exc:
            raise UsageError(str(exc)) from None


_JOB_USAGE = {"jobs": "no arguments", "attach": "at most a job id", "cancel": "a job id",
              "forget": "a job id", "logs": "a job id"}


_CLUSTER_USAGE = ("%taas cluster takes one address (what ray.init(address=...) takes) or 'local', "
                  "and optionally --workdir auto|shared|copy and --workdir-limit SIZE (like 2G)")


def _cluster_words(words: list[str]) -> tuple[str | None, dict]:
    """``%taas cluster``'s words: the address (or None) and the working directory's settings."""
    from taas.workdir import sync as workdir_sync

    address, settings = None, {}
    words = [part for word in words for part in (word.split("=", 1) if word.startswith("--") else [word])]
    while words:
        word = words.pop(0)
        if word in ("--workdir", "--workdir-limit"):
            if not words:
                raise UsageError(_CLUSTER_USAGE)
            value = words.pop(0)
            if word == "--workdir":
                if value not in workdir_sync.MODES:
                    raise UsageError(f"--workdir takes auto, shared or copy, not {value!r}")
                settings["workdir"] = value
            else:
                try:
                    settings["workdir_limit"] = workdir_sync.parse_size(value)
                except ValueError as exc:
                    raise UsageError(f"--workdir-limit: {exc}") from None
        elif word.startswith("-") or address is not None:
            raise UsageError(_CLUSTER_USAGE)
        else:
            address = word
    return address, settings
