"""The ``%%taas`` directive: its options and the ``#pragma taas`` spelling of it.

Pure functions only (no IPython, no processes), so every rule here is a table test.

* :func:`parse_options` turns the text after ``%%taas`` into a frozen :class:`JobOptions`;
  :func:`format_options` renders the non-default ones back (``parse_options`` round-trips it).
  :data:`HELP` is the full help text (the ``%%taas?`` docstring).
* :func:`resolve_world` decides (world size, device, backend, note) from the options and the
  number of CUDA devices the machine has.
* :func:`pragma_transformer` is an IPython ``input_transformers_cleanup`` hook: it takes a
  cell as a list of lines (each ending in ``'\\n'``, the last one may not) and returns a list of
  lines. A cell whose first line is ``#pragma taas ARGS`` (only blank lines and DataSphere
  ``#!NAME`` configuration lines may come before it) becomes ``%%taas ARGS [--config NAME]``,
  with the lines up to and including the pragma blanked, so that line k of the body is still
  line k of the cell. Any other cell comes back unchanged; a pragma comment anywhere else is an
  error.  A directive is a whole-line comment ``#pragma taas`` alone or followed by options
  (``--...``): ``# pragma taas is great`` is prose, and text inside a string is never one.

All bad input raises :class:`taas.errors.DirectiveError` with a one-line message.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import shlex
from dataclasses import dataclass, fields

from taas.errors import DirectiveError


@dataclass(frozen=True)
class JobOptions:
    gpus: int | None = None  # ranks, one GPU each; None = all visible GPUs (1 CPU rank if none)
    cpus: int = 1  # loader worker processes per registered loader
    units: int | None = None  # units each registered loader must produce; None = one pass
    backend: str = "auto"  # auto | nccl | gloo
    device: str = "auto"  # auto | cuda | cpu
    timeout: float | None = None  # whole-job wall-clock limit in seconds (also hang limit)
    show: tuple[int, ...] | None = None  # ranks whose output streams live; None = all
    results: bool = True  # return rank 0's new names / last expression to the notebook
    results_device: str = "cpu"  # where rank 0's tensors come back: cpu | keep (their device)
    config: str | None = None  # DataSphere '#!NAME' configuration (shown, otherwise ignored)
    storage: str = "layer"  # what ranks > 0 may write: layer | strict | shared (taas.workdir.storage)
    stall: float = 60.0  # seconds without output before the ranks' places are shown; 0 = never
    max_restarts: int = 0  # times a failed job starts again (torchrun's --max-restarts)
    cluster: str | None = None  # Ray cluster address for this cell; "local" = this machine
    keep: float | None = None  # keep the ranks after the cell, idle at most this long (s); inf = no limit
    fresh: bool = False  # end kept ranks first and start fresh ones (with --detach: a new job)
    detach: bool = False  # the job outlives the kernel: the cell returns once the ranks run
    no_wait: bool = False  # GPUs leased by other jobs: fail at once instead of waiting in line


_SEE_HELP = "see %%taas? for the options"

# Upper bounds checked before anything starts: one process per rank (and per loader worker)
# on this machine, each costing the kernel three pipes.  Far above what one machine runs
# usefully, low enough that a typo (--gpus 10**20) is a clear error, not a broken job.
MAX_RANKS = 1024
MAX_LOADER_WORKERS = 256
MAX_RESTARTS = 100


def _positive_int(flag, limit=None, what=""):
    def convert(text):
        value = _parsed(text, int)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        if limit is not None and value > limit:
            shown = text if len(text) <= 20 else text[:17] + "..."
            raise argparse.ArgumentTypeError(
                f"{flag} {shown} is more than taas runs ({limit} {what} at most); "
                f"use {flag} {limit} or fewer")
        return value
    return convert


def _parsed(text: str, kind=float):
    """``text`` as a number of ``kind``, or -1 when it is none (every option here wants >= 0)."""
    try:
        return kind(text)
    except ValueError:
        return kind(-1)


def _timeout(text):
    value = _parsed(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"--timeout must be a positive number of seconds, got {text!r}")
    return value


def _stall(text):
    value = _parsed(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"--stall must be a number of seconds (0 turns it off), got {text!r}")
    return value


def _max_restarts(text):
    value = _parsed(text, int)
    if not 0 <= value <= MAX_RESTARTS:
        raise argparse.ArgumentTypeError(
            f"--max-restarts must be a whole number from 0 to {MAX_RESTARTS}, got {text!r}")
    return value


_UNITS = {"s": 1, "m": 60, "h": 3600}
KEEP_DEFAULT = math.inf  # --keep without a limit: kept until released, the kernel ends, or unload


def _keep(text):
    """``--keep`` idle limit: ``90s``, ``30m``, ``2h`` or plain seconds."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    value = _parsed(number) * _UNITS[unit]
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"--keep takes an idle limit such as 90s, 30m or 2h, got {text!r}")
    return value


def _cluster(text):
    if not text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(
            f"--cluster takes one address as ray.init takes it (like 10.0.0.1:6379, auto) or "
            f"'local', got {text!r}")
    return text


def _show(text):
    if text.strip().lower() == "all":
        return None
    ranks = set()
    for part in text.split(","):
        if not re.fullmatch(r"[0-9]+", part.strip()):
            raise argparse.ArgumentTypeError(
                f"--show takes 'all' or rank numbers separated by commas (like 0,2), got {text!r}")
        ranks.add(int(part))
    return tuple(sorted(ranks))


def _config(text):
    if not text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(
            f"--config takes one configuration name without spaces (like g2.8), got {text!r}")
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit the kernel
        raise DirectiveError(f"{message}; {_SEE_HELP}")


_PARSER = _Parser(
    prog="%%taas",
    description="Run this cell as an N-rank torch.distributed job: every rank runs the cell\n"
    "with the notebook's values; rank 0's new names come back to the notebook.",
    epilog="The first line of a cell may also be a comment, for code that must stay plain "
    "Python:\n\n    #!g2.8                      (optional DataSphere configuration line)\n"
    "    #pragma taas --gpus 2 --units 1000\n    <cell body>\n\n"
    "which runs as '%%taas --gpus 2 --units 1000 --config g2.8'.",
    formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=88),
    add_help=False,
    allow_abbrev=False,
    exit_on_error=False,
)
_PARSER.add_argument("--gpus", metavar="N", type=_positive_int("--gpus", MAX_RANKS, "ranks"),
                     help="number of ranks, one GPU each (default: all visible GPUs; "
                     "1 CPU rank if there is none)")
_PARSER.add_argument("--cpus", metavar="M", default=1,
                     type=_positive_int("--cpus", MAX_LOADER_WORKERS, "loader workers per loader"),
                     help="loader worker processes per registered loader (default: 1)")
_PARSER.add_argument("--units", metavar="K", type=_positive_int("--units"),
                     help="units each registered loader must produce (default: one pass)")
_PARSER.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                     help="process-group backend (default: auto = nccl on CUDA, gloo on CPU)")
_PARSER.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="device of the ranks (default: auto = cuda if there is a GPU)")
_PARSER.add_argument("--timeout", metavar="SECONDS", type=_timeout,
                     help="wall-clock limit of the whole job; also how long a collective or "
                     "a loader may hang (default: none)")
_PARSER.add_argument("--stall", metavar="SECONDS", type=_stall, default=60.0,
                     help="when no rank printed anything for this long, show the line and call "
                     "each rank is at, once per silence, without stopping the job (default: 60; "
                     "0 = never)")
_PARSER.add_argument("--max-restarts", metavar="R", dest="max_restarts", type=_max_restarts, default=0,
                     help="when a rank or loader worker fails, stop the whole job and start it "
                     "again, up to R times (TORCHELASTIC_RESTART_COUNT tells the attempt); default 0")
_PARSER.add_argument("--show", metavar="all|0|0,2", type=_show,
                     help="ranks whose output streams live (default: all); the others' output "
                     "is still shown if the job fails")
_PARSER.add_argument("--no-results", dest="results", action="store_false",
                     help="do not return rank 0's new names and last expression")
_PARSER.add_argument("--results-device", dest="results_device", choices=("cpu", "keep"), default="cpu",
                     help="where tensors and modules in rank 0's results come back: cpu = on "
                     "the CPU, so the kernel holds no GPU memory after the job (default); keep = "
                     "on the CUDA device they had on rank 0 (cuda:0), when the kernel sees CUDA "
                     "(else cpu)")
_PARSER.add_argument("--storage", choices=("layer", "strict", "shared"), default="layer",
                     help="what ranks other than 0 may do to the working directory: layer = "
                     "write a private layer, merged back after the job when it does not conflict "
                     "(default); strict = only read it (DataSphere's rule); shared = write it "
                     "directly (for code that coordinates its own writes)")
_PARSER.add_argument("--cluster", metavar="ADDRESS", type=_cluster,
                     help="run this cell on the Ray cluster at ADDRESS (what ray.init(address=...) "
                     "takes; 'local' = this machine). Default: the session's (%%taas cluster "
                     "ADDRESS), else $RAY_ADDRESS, else this machine. taas never starts a cluster")
_PARSER.add_argument("--keep", metavar="LIMIT", nargs="?", const=KEEP_DEFAULT, type=_keep,
                     help="keep the ranks after the cell, with their namespaces and process group: "
                     "the next cells of the same world run on them. LIMIT (90s, 30m, 2h) ends them "
                     "after that long idle (default: kept until %%taas release, %%unload_ext or "
                     "the kernel ends)")
_PARSER.add_argument("--fresh", action="store_true",
                     help="end kept ranks first and run this cell on fresh ones; with --detach, "
                     "start a new job even if this cell's job still runs")
_PARSER.add_argument("--detach", action="store_true",
                     help="run the job outside the kernel: the cell returns once the ranks run, "
                     "naming the job; it goes on if the kernel restarts or dies. Follow it with "
                     "%%taas attach ID (its output, then its results) or `taas attach ID` in a terminal. "
                     "With --keep the kept ranks outlive the kernel too: %%taas attach ID makes them "
                     "this notebook's kept ranks")
_PARSER.add_argument("--no-wait", action="store_true",
                     help="when other jobs on this machine hold the GPUs this job needs, fail at "
                     "once, saying who holds them, instead of waiting in line for them")
_PARSER.add_argument("--config", metavar="NAME", type=_config,
                     help="DataSphere configuration name, as in a '#!NAME' line (shown by "
                     "the %%taas line magic, otherwise ignored)")

HELP: str = _PARSER.format_help()
_FLAGS = sorted(o for a in _PARSER._actions for o in a.option_strings)


@functools.lru_cache(maxsize=64)
def parse_options(argline: str) -> JobOptions:
    """Parse the text after ``%%taas`` (or ``#pragma taas``) into :class:`JobOptions`.
    Remembered per line (JobOptions is frozen; a refused line is parsed again each time): a
    notebook runs the same few lines over and over, and argparse took a few tenths of a
    millisecond of every kept cell."""
    try:
        argv = shlex.split(argline, comments=True)
    except ValueError as exc:
        raise DirectiveError(f"cannot split the options ({exc}): check the quotes") from None
    try:
        ns, extra = _PARSER.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        flag = exc.argument_name or "%%taas"
        message = exc.message if exc.message.startswith(flag) else f"{flag}: {exc.message}"
        raise DirectiveError(f"{message}; {_SEE_HELP}") from None
    for arg in extra:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, _FLAGS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DirectiveError(f"unknown option {name!r}{hint}; {_SEE_HELP}")
        raise DirectiveError(
            f"unexpected argument {arg!r}: %%taas takes only --options; {_SEE_HELP}")
    if ns.backend == "nccl" and ns.device == "cpu":
        raise DirectiveError("--backend nccl needs CUDA but --device cpu was given; "
                             "use --backend gloo for CPU ranks")
    if ns.keep is not None and ns.max_restarts:
        raise DirectiveError("--keep cannot be combined with --max-restarts: a restart cannot "
                             "bring the kept state back")
    return JobOptions(**vars(ns))


def format_options(opts: JobOptions) -> str:
    """The non-default options as a flag string (``parse_options`` reads it back to ``opts``)."""
    out = []
    for f in fields(JobOptions):
        value = getattr(opts, f.name)
        if value == f.default:
            continue
        if f.name == "results":
            out.append("--no-results")
        elif f.name == "show":
            out.append("--show " + ",".join(map(str, value)))
        elif f.name == "fresh":
            out.append("--fresh")
        elif f.name == "keep":
            out.append("--keep" if value == KEEP_DEFAULT else f"--keep {value:g}s")
        elif f.name in ("timeout", "stall"):
            out.append(f"--{f.name} {int(value) if float(value).is_integer() else repr(value)}")
        else:
            out.append(f"--{f.name.replace('_', '-')} {shlex.quote(str(value))}")
    return " ".join(out)


def resolve_world(opts: JobOptions, cuda_devices: int,
                  where: str = "this machine") -> tuple[int, str, str, str | None]:
    """(world_size, 'cuda'|'cpu', 'nccl'|'gloo', note or None) for ``opts`` on ``where``
    (this machine, or the cluster), whose ranks can use ``cuda_devices`` CUDA devices."""
    if opts.device == "cuda" and cuda_devices <= 0:
        raise DirectiveError(f"--device cuda but {where} has no CUDA device; "
                             "drop --device (or use --device cpu) to run CPU ranks")
    device = opts.device if opts.device != "auto" else ("cuda" if cuda_devices > 0 else "cpu")
    note = None
    if device == "cuda":
        backend = "nccl" if opts.backend == "auto" else opts.backend
        if opts.gpus is not None and opts.gpus > cuda_devices:
            raise DirectiveError(
                f"--gpus {opts.gpus} asks for more GPUs than {where} has ({cuda_devices}); "
                f"use --gpus {cuda_devices} or fewer, or --device cpu for CPU ranks"
                + ("; for more GPUs, run it on a Ray cluster (%taas cluster ADDRESS, or --cluster "
                   "ADDRESS)" if where == "this machine" else ""))
        world = opts.gpus if opts.gpus is not None else cuda_devices
    else:
        if opts.backend == "nccl" and opts.device == "cpu":
            raise DirectiveError("--backend nccl needs CUDA but --device cpu was given; "
                                 "use --backend gloo for CPU ranks")
        backend = "gloo"
        world = opts.gpus if opts.gpus is not None else 1
        if opts.device == "auto":
            ranks = f"{world} CPU rank{'s' if world != 1 else ''}"
            instead = " instead of nccl" if opts.backend == "nccl" else ""
            here = "here" if where == "this machine" else f"on {where}"
            note = f"taas: no CUDA device {here}: running {ranks} on gloo{instead}"
    if opts.show and max(opts.show) >= world:
        raise DirectiveError(f"--show {','.join(map(str, opts.show))} names rank {max(opts.show)} "
                             f"but the job has {world} rank(s) (0..{world - 1})")
    return world, device, backend, note


def note_fact(note: str) -> str:
    """What a :func:`resolve_world` note states, less the number of ranks: the fact ("no CUDA
    device here: CPU ranks on gloo") that a session shows once, and again only when it changes
    (a job on the cluster, or after jobs on CUDA), not for every other ``--gpus N``."""
    return re.sub(r"running \d+ CPU ranks? on", "running CPU ranks on", note)


PRAGMA_RE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+taas(?:[ \t]+(?P<args>.*?))?[ \t]*\r?\n?$")
CONFIG_LINE_RE = re.compile(r"^#!(?P<name>\S+)\s*$")
_MAGIC_RE = re.compile(r"^%%taas(?:\s|$)")
# Cell magics whose body is not Python (a file's text, a shell script...): never searched.
_FOREIGN_RE = re.compile(r"^%%(?:writefile|file|bash|sh|script|html|HTML|javascript|js|latex|"
                         r"markdown|svg|perl|ruby|python2|python3|pypy|sql)(?:\s|$)")
_HAS_CONFIG_RE = re.compile(r"(?:^|\s)--config(?:=|\s|$)")


def pragma_transformer(lines: list[str]) -> list[str]:
    """IPython cleanup transformer: ``#pragma taas ARGS`` as first line -> ``%%taas ARGS``."""
    config = None
    first = None  # index of the first line that is neither blank nor '#!NAME'
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        match = CONFIG_LINE_RE.match(line)
        if match:
            config = match.group("name")
            continue
        first = i
        break
    if first is None or _MAGIC_RE.match(lines[first]) or _FOREIGN_RE.match(lines[first]):
        return lines
    head = _directive(lines[first])
    for i in _pragma_comment_lines(lines, first + 1 if head else first):
        if head:
            raise DirectiveError(
                f"'#pragma taas' must be the first line of the cell, once (line {i + 1} "
                f"here repeats the one on line {first + 1}); remove the repeat")
        raise DirectiveError(
            f"'#pragma taas' must be the first line of the cell (line {i + 1} here); move it "
            "to the top (only blank lines and '#!' configuration lines may come before it)")
    if not head:
        return lines
    args = head.group("args") or ""
    if config is not None and not _HAS_CONFIG_RE.search(args):
        args = f"{args} --config {shlex.quote(config)}".strip()
    magic = f"%%taas {args}".rstrip() + "\n"
    return [magic] + ["\n"] * first + list(lines[first + 1:])


def _pragma_comment_lines(lines: list[str], start: int):
    """Indexes (from ``start``) of the lines that are a misplaced directive: a comment that is
    the whole line (not text inside a string) and reads as a directive (see :func:`_directive`).

    The cell is tokenized as Python; IPython syntax (``%time``, ``!ls``) tokenizes too.  Where
    tokenizing stops (an unclosed bracket or string), the rest is not searched: the cell's own
    SyntaxError will say what is wrong with it."""
    import io
    import tokenize

    if not any(_directive(line) for line in lines[start:]):  # the common case, cheaply
        return
    readline = io.StringIO("".join(lines)).readline
    try:
        for token in tokenize.generate_tokens(readline):
            row, col = token.start
            i = row - 1
            if token.type != tokenize.COMMENT or i < start or token.line[:col].strip():
                continue
            if _directive(token.string):
                yield i
    except (tokenize.TokenError, SyntaxError):
        return


def _directive(line: str):
    """The PRAGMA_RE match of ``line`` if it is a directive: ``#pragma taas`` alone or followed
    by options (its first word starts with '-'); words that are not options make it prose."""
    head = PRAGMA_RE.match(line)
    if head is None:
        return None
    args = (head.group("args") or "").strip()
    return head if not args or args.startswith("-") else None
