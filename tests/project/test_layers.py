"""The rooms of taas, checked on the source: who may import whom, and where IPython may appear.

Read with ``ast`` (nothing is imported), so an import inside a function counts as much as one at
the top of a module, and so does a module named in a string for someone to import later (an
entry point ``"taas.rank.main:main"``, a preload list, ``"module://..."``).  Each folder is a
room; a module may import its own room and the rooms ROOMS lists for it, and those lists form no
loop; a module it may not import it may name only where BY_NAME says so.  Rooms below get what
they need from above as plain values and callables (the display formatter rank 0 uses, where the
notebook's names live, how a stand-in finds its loader's view, the transport the session picked).
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "taas"

# The rooms of taas and what each may import.  A room is a folder (its modules, not its
# sub-folders: those are rooms of their own) or a top-level module.  A module may import its own
# room and the rooms listed for it, nothing else; the listed graph must have no loop, so no two
# rooms ever import each other, directly or round a loop.  The order below is bottom to top.
ROOMS: dict[str, set[str]] = {
    "taas.errors": set(),
    "taas.shield": set(),
    "taas.ready": set(),  # poll(2) for every room that waits on a descriptor
    # Pure logic and formats both sides of a job agree on.
    "taas.directive": {"taas.errors"},
    "taas.io": {"taas.errors"},
    "taas.job.memory": {"taas.errors", "taas.shield", "taas.ready"},
    "taas.job": {"taas.errors", "taas.job.memory"},
    "taas.workdir": {"taas.errors", "taas.io", "taas.shield"},
    # GPU leases on one machine: lock files, the line, the decisions (the session joins them).
    "taas.leases": {"taas.errors"},
    # The launcher contract (api, rendezvous) and what a launched process may use.
    "taas.launch": {"taas.errors", "taas.shield"},
    "taas.launch.process": {"taas.launch"},
    # The launchers: never the data plane or the rank runtime (the session joins them).
    "taas.launch.local": {"taas.errors", "taas.shield", "taas.launch", "taas.launch.process",
                          "taas.workdir"},
    "taas.launch.ray": {"taas.errors", "taas.shield", "taas.ready", "taas.io", "taas.launch",
                        "taas.launch.process", "taas.launch.local", "taas.workdir"},
    # The data plane: its contract and core, then the two transports.
    "taas.data": {"taas.errors", "taas.io", "taas.job", "taas.launch", "taas.launch.process"},
    "taas.data.shm": {"taas.errors", "taas.ready", "taas.data"},
    "taas.data.tcp": {"taas.errors", "taas.ready", "taas.io", "taas.data", "taas.data.shm", "taas.launch",
                      "taas.launch.process"},
    # The rank runtime sits above the data plane and the process side of the launcher.
    "taas.rank": {"taas.errors", "taas.shield", "taas.job", "taas.data", "taas.launch",
                  "taas.launch.process"},
    # One kernel's job runner (no IPython): the supervisor, and the session (composition root:
    # it picks the launcher and the transport).
    "taas.supervisor": {"taas.errors", "taas.shield", "taas.ready", "taas.io", "taas.job", "taas.workdir",
                        "taas.launch", "taas.launch.process", "taas.data"},
    # The composition root's plain choices: the default launcher, the transport, processes' env.
    "taas.wiring": {"taas.errors", "taas.launch", "taas.launch.local", "taas.data", "taas.data.shm",
                    "taas.data.tcp", "taas.job"},
    # What every job of a cell goes through around its run (the session's and a job host's).
    "taas.cellrun": {"taas.errors", "taas.io", "taas.job", "taas.job.memory", "taas.rank", "taas.data"},
    # The session's kept ranks: a part of the Session, apart to keep each readable.
    "taas.keptrun": {"taas.cellrun", "taas.directive", "taas.errors", "taas.io", "taas.job", "taas.job.memory",
                     "taas.supervisor"},
    "taas.session": {"taas.keptrun", "taas.cellrun", "taas.wiring", "taas.errors", "taas.shield",
                     "taas.directive", "taas.io", "taas.job",
                     "taas.job.memory", "taas.workdir", "taas.launch", "taas.launch.local",
                     "taas.launch.ray", "taas.data", "taas.data.shm", "taas.data.tcp",
                     "taas.rank", "taas.supervisor", "taas.leases"},
    # Jobs that outlive the kernel: their records on disk (pure file operations), the job host
    # that runs one with a Session of its own (and the viewer's side of it), the terminal face.
    "taas.jobs": {"taas.errors", "taas.ready", "taas.io"},
    "taas.host": {"taas.errors", "taas.cellrun", "taas.session", "taas.jobs", "taas.job", "taas.io", "taas.data",
                  "taas.directive", "taas.workdir", "taas.supervisor", "taas.wiring", "taas.shield",
                  "taas.ready"},
    # A detached job on a Ray cluster: its host a detached actor, its records in the cluster's KV.
    "taas.host.ray": {"taas.errors", "taas.shield", "taas.host", "taas.jobs", "taas.session", "taas.launch.ray"},
    "taas.cli": {"taas.errors", "taas.host", "taas.host.ray", "taas.jobs", "taas.leases"},
    # The notebook face.
    "taas.status": {"taas.session", "taas.data"},
    "taas.notebook": {"taas.errors", "taas.directive", "taas.job"},
    "taas.magics": {"taas.errors", "taas.directive", "taas.job", "taas.workdir", "taas.session",
                    "taas.status", "taas.host", "taas.host.ray", "taas.jobs", "taas.notebook"},
    "taas": {"taas.data", "taas.magics", "taas.notebook", "taas.session"},
}

# Modules a room names in a string though its room may not import them, for a job's processes:
# a rank imports them from that name (an entry point, matplotlib's backend), or the start
# process does before it forks the ranks (a preload); no code of the naming room uses them.
# Exact modules, not rooms: naming anything else of those rooms fails like an import.  Together
# with ROOMS they still form no loop.
BY_NAME: dict[str, set[str]] = {
    # starter.PRELOAD: the start process imports the rank runtime before it forks, so that a
    # job's ranks start warm; the launcher starts whatever entry a ProcessSpec names.
    "taas.launch.local": {"taas.rank.main"},
    # Supervisor._spec: each rank's ProcessSpec.entry, "taas.rank.main:main".
    "taas.supervisor": {"taas.rank.main"},
    # process_env: MPLBACKEND="module://taas.rank.mpl_backend", imported by matplotlib in a rank.
    "taas.wiring": {"taas.rank.mpl_backend"},
}

# Modules allowed to import IPython (anywhere in the module).
IPYTHON_ALLOWED = {"taas.magics", "taas.notebook", "taas"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    """The room of ``module``: itself when it is a top-level module or a room's package, else
    the package it lives in."""
    if module in ROOMS:
        return module
    room = module.rpartition(".")[0]
    if room not in ROOMS:
        raise AssertionError(f"{module} is in no room: add its folder to ROOMS in {__file__}")
    return room


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _parse(module: str, source: str | None) -> ast.Module:
    path = MODULES.get(module, pathlib.Path(f"<{module}>"))
    return ast.parse(path.read_text() if source is None else source, str(path))


def _imports(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``module`` (or in ``source`` read as
    ``module``), at any depth, relative ones resolved; ``from P import n`` counts as P.n when
    that is a module, else as P."""
    tree = _parse(module, source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.append((child if child in MODULES else base, node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module"
                   or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            found.append((node.args[0].value, node.lineno))  # importlib with a literal name
    return found


# A string that is a dotted taas module's name, maybe with ":attr" (an entry point) or behind
# "module://" (matplotlib's spelling of a backend module).
_MODULE_NAME = re.compile(r"(?:module://)?(taas(?:\.\w+)+)(?::[\w.]+)?")


def _named(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(taas module, line) for every string constant in ``module`` (or ``source``) that names one:
    an import by computed name, done later by whoever the string is handed to (a preload list,
    a ProcessSpec's entry, an environment variable).  Docstrings and logger names do not count."""
    tree = _parse(module, source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            skip.add(id(body[0].value))  # a docstring
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
            skip.update(id(arg) for arg in node.args)  # logging's names, not modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            match = _MODULE_NAME.fullmatch(node.value)
            if match and match.group(1) in MODULES:
                found.append((match.group(1), node.lineno))
    return sorted(found, key=lambda ref: ref[1])


def _own(name: str) -> str | None:
    """The taas module ``name`` refers to (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def test_every_module_has_a_room_and_every_room_a_module():
    rooms = {_room(module) for module in MODULES}
    assert rooms == set(ROOMS), set(ROOMS) ^ rooms


def test_the_rooms_form_no_loop():
    # Kahn's algorithm over the allowed edges: what is left at the end sits on a loop.
    assert all(set(allowed) <= set(ROOMS) for allowed in ROOMS.values())
    left = _on_a_loop({room: set(allowed) for room, allowed in ROOMS.items()})
    assert left == set(), f"rooms on a loop: {sorted(left)}"


def _on_a_loop(graph: dict[str, set]) -> set:
    """Kahn's algorithm over ``graph`` (room -> rooms it depends on): what is left at the end
    sits on a loop (or depends on one)."""
    left = {room: set(edges) - {room} for room, edges in graph.items()}
    while True:
        free = [room for room, edges in left.items() if not edges]
        if not free:
            return set(left)
        for room in free:
            del left[room]
        for edges in left.values():
            edges.difference_update(free)


def test_each_room_says_what_it_is_for():
    for room in ROOMS:
        path = MODULES[room]
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{path} has no docstring"


def test_only_the_notebook_layer_imports_ipython():
    offenders = [f"{module}:{line} imports {name}"
                 for module in MODULES if module not in IPYTHON_ALLOWED
                 for name, line in _imports(module)
                 if name == "IPython" or name.startswith("IPython.")]
    assert offenders == [], offenders


def _offenders(module: str, source: str | None = None,
               by_name: dict[str, set[str]] | None = None) -> list[str]:
    """What ``module`` (or ``source`` read as ``module``) imports, or names in a string, that its
    room may not: a name is allowed where ``by_name`` (BY_NAME) declares that exact module."""
    by_name = BY_NAME if by_name is None else by_name
    room, offenders = _room(module), []
    for how, refs in (("imports", _imports(module, source)), ("names", _named(module, source))):
        for name, line in refs:
            target = _own(name) if name.split(".")[0] == "taas" else None
            if target is None or _room(target) == room or _room(target) in ROOMS[room]:
                continue
            if how == "names" and target in by_name.get(room, ()):
                continue
            offenders.append(f"{module}:{line} ({room}) {how} {target} ({_room(target)})")
    return offenders


def test_no_module_imports_a_room_it_may_not():
    # Imports, and modules named in strings for a later import (allowed only as BY_NAME says).
    offenders = [line for module in MODULES for line in _offenders(module)]
    assert offenders == [], offenders


def test_every_name_allowed_by_name_is_named():
    # BY_NAME stays exact: an allowance nothing uses any more is taken out.
    named = {(_room(module), name) for module in MODULES for name, _ in _named(module)}
    unused = {(room, name) for room, names in BY_NAME.items() for name in names} - named
    assert unused == set(), unused


def test_the_rooms_and_what_they_name_form_no_loop():
    # A room naming a module for a rank to import still depends on that room: no loop either.
    left = _on_a_loop({room: set(allowed) | {_room(name) for name in BY_NAME.get(room, ())}
                       for room, allowed in ROOMS.items()})
    assert left == set(), f"rooms on a loop: {sorted(left)}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    # The checks above are only as good as _imports: it must see a lazy import too.
    found = dict(_imports("taas.rank.main"))
    assert "taas.data.view" in found  # imported inside _loader_view and _install_data_views


def test_the_checker_sees_imports_by_computed_name():
    # A module named in a string is imported later by whoever gets the string: the real ones...
    assert "taas.rank.main" in dict(_named("taas.launch.local.starter"))  # PRELOAD
    assert "taas.rank.main" in dict(_named("taas.supervisor.supervisor"))  # "taas.rank.main:main"
    assert "taas.rank.mpl_backend" in dict(_named("taas.wiring"))  # "module://taas.rank.mpl_backend"
    assert "taas.rank.main" not in dict(_imports("taas.launch.local.starter"))  # no import statement
    # ... and each is an offence unless BY_NAME declares it.
    assert _offenders("taas.launch.local.starter", by_name={}) == [
        f"taas.launch.local.starter:{dict(_named('taas.launch.local.starter'))['taas.rank.main']} "
        "(taas.launch.local) names taas.rank.main (taas.rank)"]
    source = ('"""A launcher module: its docstring may mention taas.rank.comm."""\n'
              "import logging\n"
              "log = logging.getLogger('taas.rank.comm')  # a logger's name, not a module\n"
              "PRELOAD = ('torch', 'taas.rank.main', 'taas.rank.comm')\n"
              "ENTRY = 'taas.rank.display:format_bundle'\n"
              "NOTE = 'see taas.rank.comm for how'  # prose, not a name\n")
    assert _offenders("taas.launch.local.example", source) == [
        "taas.launch.local.example:4 (taas.launch.local) names taas.rank.comm (taas.rank)",
        "taas.launch.local.example:5 (taas.launch.local) names taas.rank.display (taas.rank)"]
    assert len(_offenders("taas.launch.local.example", source, by_name={})) == 3  # taas.rank.main too


@pytest.mark.parametrize("code", [
    "import taas",
    "import taas; taas.registered(); taas.get_worker_info()",  # the data API needs no torch
])
def test_importing_taas_imports_neither_torch_nor_ipython(code):
    check = (f"{code}\nimport sys\n"
             "print(sorted(m for m in ('torch', 'IPython') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


# -- what the notebook layer hands down, as plain values ---------------------------------------
def test_rank_zero_formats_with_the_formatter_the_notebook_layer_chose():
    from taas import notebook
    from taas.job import package
    from taas.rank import display

    class Rich:
        def _repr_html_(self):
            return "<b>rich</b>"

        def __repr__(self):
            return "Rich()"

    def payload():
        return package.Payload(source="", filename="<cell>", first_line=1, names=b"", bound=(),
                               device="cpu", backend="gloo", pg_timeout=1.0)

    assert payload().display_formatter is None
    assert display.format_bundle(Rich()) == ({"text/plain": "Rich()"}, {})  # no formatter: repr
    notebook.choose_display_formatter()
    try:
        spec = payload().display_formatter
        assert spec == "IPython.core.formatters:DisplayFormatter"
        data, _ = display.format_bundle(Rich(), spec)
        assert data == {"text/plain": "Rich()", "text/html": "<b>rich</b>"}
    finally:
        notebook.forget_display_formatter()
    assert payload().display_formatter is None


def test_registered_loaders_are_named_from_the_namespace_the_notebook_layer_gives():
    from taas.data import registry

    loader = [1, 2, 3]
    before = registry._namespace_source
    registry.register(loader)
    try:
        registry.set_namespace_source(None)
        assert registry.registered() == [object.__repr__(loader)]
        registry.set_namespace_source(lambda: {"train": loader})
        assert registry.registered() == ["train"]
    finally:
        registry.unregister(loader)
        registry.set_namespace_source(before)
