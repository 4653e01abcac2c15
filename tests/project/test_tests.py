"""The test tree's own rules, checked on the source with ``ast`` (nothing is imported).

- No test module imports another test module: what two test modules share lives in
  tests/support/ (harnesses, helpers, cells) or a conftest.py (fixtures).  A test module that
  imports another one runs (or re-collects) the other's tests and ties two files' names
  together; pytest's rootdir-relative module names then decide what the import finds.
- Every folder with test modules is a package (has ``__init__.py``), as are the folders above
  it up to tests/: test modules in different folders may share a base name (two
  ``test_transport.py``), which pytest can only tell apart as ``tests.unit.data.shm.…`` modules.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

# Known imports of a test module, (importing file, imported module), each with why it is here.
# None: the list only shrinks, and it is empty.
KNOWN: dict[tuple[str, str], str] = {}


def modules() -> list[pathlib.Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path) -> set[str]:
    """Every module the file at ``path`` imports (see :func:`imports`)."""
    return imports(path.read_text(), module_name(path), path.name == "__init__.py")


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (module ``module``) imports, absolute, with ``from X import name``
    counted as X.name too (``name`` may be a module); relative imports resolved against the
    module's package."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], base]).strip(".")
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def reached_test_module(name: str) -> str | None:
    """The test module of our tests/ tree that importing ``name`` reaches (its first part named
    ``test_…``: ``tests.kernel.test_kernel.test_x`` is a function of ``tests.kernel.test_kernel``),
    or None.  A library's ``test_utils`` (``accelerate.test_utils``) is not ours to judge."""
    parts = name.split(".")
    if parts[0] != "tests":
        return None
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return ".".join(parts[:i + 1])
    return None


def test_no_test_module_imports_another_test_module():
    offending = set()
    for path in modules():
        rel = path.relative_to(ROOT).as_posix()
        for name in imported(path):
            reached = reached_test_module(name)
            if reached and (rel, reached) not in KNOWN:
                offending.add((rel, reached))
    assert not offending, "move what they share to tests/support/ or a conftest.py: " + repr(sorted(offending))


def test_the_known_test_module_imports_are_still_there():
    """An entry of KNOWN whose import went away goes too (the list only shrinks)."""
    stale = [key for key in KNOWN if not (ROOT / key[0]).exists()
             or key[1] not in {reached_test_module(name) for name in imported(ROOT / key[0])}]
    assert stale == [], stale


def test_the_import_resolver_sees_every_form():
    """``imports`` itself: absolute, ``from`` (the names as possible modules), relative."""
    names = imports("import tests.unit.x.test_a\nfrom tests.unit import test_b\n"
                    "from .test_c import f\nfrom .. import test_d\n", "tests.unit.data.tcp.test_example")
    assert {"tests.unit.x.test_a", "tests.unit.test_b", "tests.unit.data.tcp.test_c",
            "tests.unit.data.test_d"} <= names, names
    assert imports("from . import helpers\n", "tests.support", is_package=True) >= {"tests.support.helpers"}
    assert reached_test_module("tests.unit.data.tcp.test_c.f") == "tests.unit.data.tcp.test_c"
    assert reached_test_module("tests.unit.test_b") == "tests.unit.test_b"
    assert reached_test_module("accelerate.test_utils.scripts.test_script") is None
    assert reached_test_module("tests.support.kernel_driver") is None


def test_every_folder_with_test_modules_is_a_package():
    missing = set()
    for path in modules():
        if path.name.startswith("test_"):
            folder = path.parent
            while folder != ROOT:
                if not (folder / "__init__.py").exists():
                    missing.add(folder.relative_to(ROOT).as_posix())
                folder = folder.parent
    assert not missing, f"add an __init__.py to: {sorted(missing)}"


def test_support_imports_nothing_of_the_tests_outside_it():
    """tests/support sits below every test module: it never reaches up into them."""
    reaching = {(path.relative_to(ROOT).as_posix(), name)
                for path in modules() if "support" in path.relative_to(TESTS).parts[:1]
                for name in imported(path)
                if name.startswith("tests.") and not name.startswith("tests.support")}
    assert not reaching, sorted(reaching)
