"""The layers of taas, checked on the source: who may import whom, and where IPython may appear.

Read with ``ast`` (nothing is imported), so an import inside a function counts as much as one at
the top of a module.  A module may import from its own layer and the layers below, never from a
layer above: the layers below get what they need from above as plain values and callables
(the display formatter rank 0 uses, where the notebook's names live, how a stand-in finds its
loader's view).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "taas"

# Bottom to top.  An entry names a module or a package (all its modules); the longest entry
# that names a module decides its layer ("taas" itself is only taas/__init__.py).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("taas.errors", "taas.shield")),
    # Pure logic and formats both sides of a job agree on: options, output and failure text,
    # what a cell reads, packaging, values crossing, merging layers back.
    ("logic", ("taas.directive", "taas.io", "taas.job")),
    # The job's runtime: the launcher, the rank runtime, the data plane.  They use each other's
    # small contracts (events, reports, segments, the storage rule, views), so one layer.
    ("runtime", ("taas.launch", "taas.worker", "taas.data")),
    # One kernel's job runner (no IPython): the session, and the supervisor that watches a
    # started job (taas.supervisor, where the launcher work has it).
    ("driver", ("taas.supervisor", "taas.session")),
    ("status", ("taas.status",)),  # %taas's text, over the session
    ("notebook", ("taas.magics", "taas")),  # the IPython adapter and the extension hook
]

# Modules allowed to import IPython (anywhere in the module).
IPYTHON_ALLOWED = {"taas.magics", "taas"}

# (importer, imported) pairs that go up a layer and are known.  Empty: the one there was
# (taas.job.package -> taas.data.view, a stand-in finding its loader's view) is now a lookup
# the rank runtime passes to package.unship.  Add an entry only with a comment saying why.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best, found = -1, None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = name == "taas"
            if module == name or (not exact and module.startswith(name + ".")):
                if len(name) > best:
                    best, found = len(name), index
    if found is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return found


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``module``, at any depth, relative ones
    resolved; ``from P import n`` counts as P.n when that is a module, else as P."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
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


def _own(name: str) -> str | None:
    """The taas module ``name`` refers to (the longest known prefix), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_only_the_notebook_layer_imports_ipython():
    offenders = [f"{module}:{line} imports {name}"
                 for module in MODULES if module not in IPYTHON_ALLOWED
                 for name, line in _imports(module)
                 if name == "IPython" or name.startswith("IPython.")]
    assert offenders == [], offenders


def test_no_module_imports_from_a_layer_above_it():
    upward, seen = [], set()
    for module in MODULES:
        for name, line in _imports(module):
            target = _own(name) if name.split(".")[0] == "taas" else None
            if target is None or _layer(target) <= _layer(module):
                continue
            seen.add((module, target))
            if (module, target) not in KNOWN_UPWARD:
                upward.append(f"{module}:{line} ({LAYERS[_layer(module)][0]}) imports {target} "
                              f"({LAYERS[_layer(target)][0]})")
    assert upward == [], upward
    assert KNOWN_UPWARD <= seen, f"known exceptions that no longer occur: {KNOWN_UPWARD - seen}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    # The checks above are only as good as _imports: it must see a lazy import too.
    found = dict(_imports("taas.worker.rank"))
    assert "taas.data.view" in found  # imported inside _loader_view and _install_data_views


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
    from taas import magics
    from taas.job import package
    from taas.worker import display

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
    magics.choose_display_formatter()
    try:
        spec = payload().display_formatter
        assert spec == "IPython.core.formatters:DisplayFormatter"
        data, _ = display.format_bundle(Rich(), spec)
        assert data == {"text/plain": "Rich()", "text/html": "<b>rich</b>"}
    finally:
        magics.forget_display_formatter()
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
