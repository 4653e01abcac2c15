"""A rank's small shell: what IPython syntax in a taas cell does in a rank, without IPython.

The notebook face turns ``%run``, ``!cmd``, ``x = !cmd``, ``%time`` ... into calls of
:data:`taas.job.syntax.SHELL` (:func:`taas.job.syntax.route`); :func:`install` puts a
:class:`RankShell` under that name in the cell's namespace before each cell.  Each call does
what IPython does in a notebook, here:

* ``%run [-i] [-n] [-e] [-G] script.py ARGS`` (or ``-m module``): the script as
  ``python script.py ARGS`` runs it under torchrun (``__name__ == "__main__"``, ``sys.argv``,
  its folder first on ``sys.path``), in a namespace of its own whose names then land in the
  cell's, as IPython's ``%run`` does (``-i``: in the cell's namespace itself);
* ``!cmd`` runs in the rank's shell, in its working directory and environment, its output the
  rank's (tagged like any other); ``x = !cmd`` (``%sx``, ``%system``) gives its output lines as
  an :class:`~taas.job.syntax.SList`;
* ``%time``, ``%timeit``, ``%env``, ``%set_env``, ``%cd``, ``%pwd``.

``$name`` and ``{expr}`` expand as in IPython, in the caller's scope.  Frames here are taas's
own, so a rank's traceback (taas.launch.process.report) skips them: it goes from the cell's
line to the script's or the timed code's.
"""

from __future__ import annotations

import ast
import builtins
import glob
import importlib.util
import linecache
import os
import subprocess
import sys
import time
import timeit
import types

from taas.job import syntax

__all__ = ["RankShell", "UsageError", "install"]


class UsageError(Exception):
    """A magic used in a way a rank cannot run (as IPython's UsageError)."""


def install(namespace: dict) -> None:
    """Before each cell: the rank's shell, for the calls IPython syntax became."""
    namespace[syntax.SHELL] = RankShell(namespace)


# A module's own names, which a script's namespace starts with: they stay the script's.
_MODULE_NAMES = frozenset(vars(types.ModuleType("m"))) | {"__file__", "__builtins__"}
_SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"  # as IPython's system


class RankShell:
    def __init__(self, user_ns: dict):
        self.user_ns = user_ns
        self._previous_dir: str | None = None  # for `%cd -`

    # -- the calls the transformed cell makes ----------------------------------------------
    def run_line_magic(self, name: str, line: str, _stack_depth: int = 1):
        frame = sys._getframe(1)
        method = getattr(self, f"_magic_{name}", None) if name in syntax.LINE_MAGICS else None
        if method is None:  # refused before launch when written as %name; this is a computed call
            raise UsageError(f"%{name} has no meaning in a taas rank")
        if name not in ("time", "timeit"):
            line = self._expand(line, frame)
        return method(line, frame)

    def run_cell_magic(self, name: str, line: str, cell: str):
        raise UsageError(f"%%{name} is a cell magic, which cannot run inside a taas cell")

    def system(self, cmd: str) -> None:
        """``!cmd``: in the rank's shell; its exit status in ``_exit_code``, as IPython does."""
        cmd = self._expand(cmd, sys._getframe(1))
        sys.stdout.flush()
        sys.stderr.flush()
        code = subprocess.call(cmd, shell=True, executable=_SHELL, stdin=subprocess.DEVNULL)
        self.user_ns["_exit_code"] = code

    def getoutput(self, cmd: str, split: bool = True, depth: int = 0):
        """``x = !cmd``: the command's output (stdout and stderr) as lines."""
        return self._getoutput(self._expand(cmd, sys._getframe(1 + depth)), split)

    # -- magics ------------------------------------------------------------------------------
    def _magic_run(self, line: str, frame) -> None:
        try:
            args = syntax.parse_run(line)
        except ValueError as exc:
            raise UsageError(f"%run: {exc}") from None
        filename = _find_module(args.target) if args.module else _find_script(args.target)
        argv = list(args.argv) if args.no_glob else _glob([os.path.expanduser(a) for a in args.argv])
        name = "__main__" if not args.not_main else (args.target if args.module else
                                                    os.path.splitext(os.path.basename(filename))[0])
        module = types.ModuleType(name)
        namespace = self.user_ns if args.interactive else module.__dict__
        saved_file = namespace.get("__file__")
        namespace.update(__file__=os.path.abspath(filename), __builtins__=builtins)
        saved = sys.argv, sys.modules.get("__main__")
        sys.argv = [filename, *argv]
        folder = os.path.dirname(os.path.abspath(filename))
        if folder not in sys.path:  # as `python script.py`: its folder first, for the process's life
            sys.path.insert(0, folder)
        if name == "__main__" and not args.interactive:
            sys.modules["__main__"] = module  # pickle finds the script's classes as __main__'s
        try:
            with open(filename, "rb") as f:
                code = compile(f.read(), filename, "exec", dont_inherit=True)
            try:
                exec(code, namespace)
            except SystemExit as exc:  # the script ended: the cell goes on, unless it failed
                if exc.code not in (None, 0) and not args.exit_ignore:
                    raise
        finally:
            sys.argv = saved[0]
            if saved[1] is not None:
                sys.modules["__main__"] = saved[1]
            if args.interactive:
                _restore(namespace, "__file__", saved_file)
        if not args.interactive:  # the script's names land in the cell's namespace, as IPython's %run
            self.user_ns.update({k: v for k, v in namespace.items() if k not in _MODULE_NAMES})

    def _magic_time(self, line: str, frame):
        glob_ns, local_ns = self.user_ns, _locals(frame)
        tree = ast.parse(line)
        expression = len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)
        source = "<timed eval>" if expression else "<timed exec>"
        linecache.cache[source] = (len(line), None, line.splitlines(keepends=True), source)
        code = (compile(ast.Expression(tree.body[0].value), source, "eval") if expression  # type: ignore[attr-defined]
                else compile(tree, source, "exec"))
        cpu, wall = os.times(), time.perf_counter()
        value = eval(code, glob_ns, local_ns) if expression else exec(code, glob_ns, local_ns)
        wall = time.perf_counter() - wall
        end = os.times()
        user, system = end.user - cpu.user, end.system - cpu.system
        print(f"CPU times: user {syntax.format_time(user)}, sys: {syntax.format_time(system)}, "
              f"total: {syntax.format_time(user + system)}\nWall time: {syntax.format_time(wall)}")
        return value

    def _magic_timeit(self, line: str, frame):
        options, code = syntax.split_timeit(line)
        if not code:
            raise UsageError("%timeit takes a statement to time")
        local_ns = _locals(frame)
        namespace = self.user_ns if local_ns is None else {**self.user_ns, **local_ns}
        timer = timeit.Timer(code, timer=time.perf_counter, globals=namespace)
        repeat = int(options.get("r", 7))
        number = int(options.get("n", 0))
        if number <= 0:  # as IPython: loops enough for 0.2 s
            number = 1
            for power in range(10):
                number = 10 ** power
                if timer.timeit(number) >= 0.2:
                    break
        runs = timer.repeat(repeat, number)
        result = syntax.TimeitResult(number, repeat, tuple(t / number for t in runs),
                                     int(options.get("p", 3)))
        if "q" not in options:
            print(result)
        return result if "o" in options else None

    def _magic_env(self, line: str, frame):
        line = line.strip()
        if not line:  # as IPython: likely secrets hidden (a rank's environment has the job's own too)
            return {k: "<hidden>" if any(s in k.lower() for s in ("key", "token", "secret")) else v
                    for k, v in os.environ.items()}
        if "=" in line or " " in line:
            return self._magic_set_env(line, frame)
        try:
            return os.environ[line]
        except KeyError:
            raise UsageError(f"%env: environment variable {line} not found") from None

    def _magic_set_env(self, line: str, frame) -> None:
        name, sep, value = line.strip().partition("=") if "=" in line.split(" ", 1)[0] \
            else line.strip().partition(" ")
        if not name or not sep:
            raise UsageError("%set_env takes NAME VALUE or NAME=VALUE")
        os.environ[name] = value.strip() if sep == " " else value
        print(f"env: {name}={os.environ[name]}")

    def _magic_cd(self, line: str, frame) -> None:
        words = line.split()
        quiet = "-q" in words
        words = [w for w in words if w != "-q"]
        if len(words) > 1 or (words and words[0].startswith("-") and words[0] != "-"):
            raise UsageError(f"%cd takes one folder, '-' or nothing in a taas rank, not {line!r}")
        target = os.path.expanduser(words[0]) if words else os.path.expanduser("~")
        if target == "-":
            if self._previous_dir is None:
                raise UsageError("%cd -: no previous folder")
            target = self._previous_dir
        here = os.getcwd()
        os.chdir(target)
        self._previous_dir = here
        if not quiet:
            print(os.getcwd())

    def _magic_pwd(self, line: str, frame) -> str:
        return os.getcwd()

    def _magic_sx(self, line: str, frame):
        return self._getoutput(line, True)

    _magic_system = _magic_sx

    # -- helpers -----------------------------------------------------------------------------
    def _expand(self, text: str, frame) -> str:
        scope = dict(self.user_ns)
        local_ns = _locals(frame)
        if local_ns:
            scope.update(local_ns)
        return syntax.expand(text, lambda expr: eval(expr, scope))

    @staticmethod
    def _getoutput(cmd: str, split: bool):
        sys.stdout.flush()
        sys.stderr.flush()
        done = subprocess.run(cmd, shell=True, executable=_SHELL, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text = done.stdout.decode(errors="replace")
        if text.endswith("\n"):
            text = text[:-1]
        return syntax.SList(text.splitlines()) if split else text


def _locals(frame) -> dict | None:
    """The caller's locals when it is a function (None at the cell's top level)."""
    return None if frame.f_locals is frame.f_globals else frame.f_locals


def _restore(namespace: dict, name: str, value) -> None:
    if value is None:
        namespace.pop(name, None)
    else:
        namespace[name] = value


def _find_script(target: str) -> str:
    """IPython's rule: the path, else the path with ``.py``."""
    path = os.path.expanduser(target)
    for candidate in (path, path + ".py"):
        if os.path.isfile(candidate):
            return candidate
    raise UsageError(f"%run: file {target!r} not found in {os.getcwd()}")


def _find_module(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise UsageError(f"%run -m: module {name!r} not found")
    return spec.origin


def _glob(args: list[str]) -> list[str]:
    """Each argument with glob characters replaced by the paths it matches (itself if none)."""
    out: list[str] = []
    for arg in args:
        matches = sorted(glob.glob(arg)) if any(c in arg for c in "*?[") else []
        out.extend(matches or [arg])
    return out
