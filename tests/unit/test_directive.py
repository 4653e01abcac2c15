"""Table tests of taas.directive: options, world resolution, the '#pragma taas' transformer."""

from __future__ import annotations

import pytest

from taas.directive import (
    HELP,
    PRAGMA_RE,
    JobOptions,
    format_options,
    note_fact,
    parse_options,
    pragma_transformer,
    resolve_world,
)
from taas.errors import DirectiveError, TaasError

# ---------------------------------------------------------------------------------------------
# parse_options: valid lines

VALID = [
    ("", JobOptions()),
    ("   ", JobOptions()),
    ("--gpus 2", JobOptions(gpus=2)),
    ("--gpus=4", JobOptions(gpus=4)),
    ("--cpus 3", JobOptions(cpus=3)),
    ("--units 1000", JobOptions(units=1000)),
    ("--backend gloo", JobOptions(backend="gloo")),
    ("--backend nccl", JobOptions(backend="nccl")),
    ("--device cpu", JobOptions(device="cpu")),
    ("--device cuda --backend nccl", JobOptions(device="cuda", backend="nccl")),
    ("--backend gloo --device cpu", JobOptions(backend="gloo", device="cpu")),
    ("--timeout 30", JobOptions(timeout=30.0)),
    ("--timeout 0.5", JobOptions(timeout=0.5)),
    ("--stall 0", JobOptions(stall=0.0)),  # off
    ("--stall 2.5", JobOptions(stall=2.5)),
    ("--stall 60", JobOptions()),  # the default
    ("--max-restarts 2", JobOptions(max_restarts=2)),
    ("--max-restarts 0", JobOptions()),
    ("--show all", JobOptions(show=None)),
    ("--show ALL", JobOptions(show=None)),
    ("--show 0", JobOptions(show=(0,))),
    ("--show 0,2", JobOptions(show=(0, 2))),
    ("--show 2,0,2", JobOptions(show=(0, 2))),
    ("--no-results", JobOptions(results=False)),
    ("--results-device keep", JobOptions(results_device="keep")),
    ("--results-device=cpu", JobOptions()),  # the default
    ("--config g2.8", JobOptions(config="g2.8")),
    ("--storage strict", JobOptions(storage="strict")),
    ("--storage shared", JobOptions(storage="shared")),
    ("--storage layer", JobOptions()),  # the default
    ("--cluster 10.0.0.1:6379", JobOptions(cluster="10.0.0.1:6379")),
    ("--cluster auto", JobOptions(cluster="auto")),
    ("--cluster ray://head:10001", JobOptions(cluster="ray://head:10001")),
    ("--cluster local", JobOptions(cluster="local")),
    ("--gpus 1 --gpus 3", JobOptions(gpus=3)),  # last one wins, as in argparse
    ("--gpus 2  # two ranks", JobOptions(gpus=2)),  # a trailing comment is ignored
    (
        "--gpus 2 --cpus 4 --units 10 --backend gloo --device cuda --timeout 90 "
        "--show 1 --no-results --config c1.4",
        JobOptions(gpus=2, cpus=4, units=10, backend="gloo", device="cuda", timeout=90.0,
                   show=(1,), results=False, config="c1.4"),
    ),
]


@pytest.mark.parametrize("line, expected", VALID, ids=[v[0] or "<empty>" for v in VALID])
def test_parse_valid(line, expected):
    assert parse_options(line) == expected


# ---------------------------------------------------------------------------------------------
# parse_options: invalid lines -> one-line DirectiveError naming the culprit

INVALID = [
    ("--results-device cuda", "--results-device: invalid choice: 'cuda' (choose from 'cpu', 'keep')"),
    ("--results-device", "--results-device"),
    ("--storage private", "--storage: invalid choice: 'private' (choose from 'layer', 'strict', 'shared')"),
    ("--gpus 0", "--gpus"),
    ("--gpus -1", "--gpus"),
    ("--gpus x", "--gpus"),
    ("--gpus 2.5", "--gpus"),
    ("--gpus", "--gpus"),
    ("--cpus 0", "--cpus"),
    ("--cpus -3", "--cpus"),
    ("--cpus two", "--cpus"),
    ("--units 0", "--units"),
    ("--units 1e3", "--units"),
    ("--timeout 0", "--timeout"),
    ("--timeout -5", "--timeout"),
    ("--timeout soon", "--timeout"),
    ("--timeout inf", "--timeout"),
    ("--timeout nan", "--timeout"),
    ("--stall -1", "--stall must be a number of seconds (0 turns it off), got '-1'"),
    ("--max-restarts -1", "--max-restarts must be a whole number from 0 to 100, got '-1'"),
    ("--max-restarts x", "--max-restarts must be a whole number from 0 to 100, got 'x'"),
    ("--max-restarts 1.5", "--max-restarts"),
    ("--max-restarts 101", "--max-restarts"),
    ("--stall x", "--stall"),
    ("--stall inf", "--stall"),
    ("--stall", "--stall"),
    ("--show -1", "--show"),
    ("--show 0,,2", "--show"),
    ("--show 0,x", "--show"),
    ("--show ''", "--show"),
    ("--show none", "--show"),
    ("--backend mpi", "--backend"),
    ("--device tpu", "--device"),
    ("--config", "--config"),
    ("--config ''", "--config"),
    ("--backend nccl --device cpu", "--backend nccl"),
    ("--gpu 2", "--gpu"),  # no abbreviations: an unknown flag
    ("--frobnicate", "--frobnicate"),
    ("--help", "--help"),
    ("-g 2", "-g"),
    ("--no-results=yes", "--no-results"),
    ("train.py", "train.py"),
    ("--gpus 2 4", "'4'"),
    ('--config "g2.8', "quote"),
    ("--cluster", "--cluster"),
    ("--cluster ''", "--cluster takes one address"),
    ("--cluster 'a b'", "--cluster takes one address"),
]


@pytest.mark.parametrize("line, mentions", INVALID, ids=[i[0] for i in INVALID])
def test_parse_invalid(line, mentions):
    with pytest.raises(DirectiveError) as info:
        parse_options(line)
    message = str(info.value)
    assert "\n" not in message, message
    assert mentions in message, message
    assert "usage:" not in message


def test_parse_error_is_a_taas_error_and_not_systemexit():
    with pytest.raises(TaasError):
        parse_options("--gpus 0")


def test_bad_value_message_shape():
    with pytest.raises(DirectiveError, match=r"^--gpus must be a positive integer, got '0'"):
        parse_options("--gpus 0")


@pytest.mark.parametrize("argline, message", [
    ("--gpus 100000000000000000000",
     r"^--gpus 10000000000000000\.\.\. is more than taas runs \(1024 ranks at most\); use --gpus 1024 or fewer"),
    ("--gpus 1025", r"^--gpus 1025 is more than taas runs \(1024 ranks at most\)"),
    ("--cpus 257", r"^--cpus 257 is more than taas runs \(256 loader workers per loader at most\)"),
])
def test_sizes_beyond_the_limits_are_one_line_errors(argline, message):
    with pytest.raises(DirectiveError, match=message):
        parse_options(argline)
    assert parse_options("--gpus 1024 --cpus 256").gpus == 1024


def test_unknown_flag_suggests_the_close_one():
    with pytest.raises(DirectiveError, match=r"did you mean --gpus\?"):
        parse_options("--gpu 2")


def test_options_are_frozen():
    opts = parse_options("--gpus 2")
    with pytest.raises(AttributeError):
        opts.gpus = 3


# ---------------------------------------------------------------------------------------------
# format_options

FORMATTED = [
    (JobOptions(), ""),
    (JobOptions(gpus=2), "--gpus 2"),
    (JobOptions(timeout=30.0), "--timeout 30"),
    (JobOptions(timeout=2.5), "--timeout 2.5"),
    (JobOptions(show=(0, 2)), "--show 0,2"),
    (JobOptions(results=False, config="g2.8"), "--no-results --config g2.8"),
    (JobOptions(gpus=2, storage="strict"), "--gpus 2 --storage strict"),
    (JobOptions(stall=0.0), "--stall 0"),
    (JobOptions(max_restarts=3), "--max-restarts 3"),
    (JobOptions(results_device="keep"), "--results-device keep"),
    (JobOptions(gpus=4, cluster="10.0.0.1:6379"), "--gpus 4 --cluster 10.0.0.1:6379"),
    (JobOptions(cpus=4, units=7, backend="gloo", device="cpu"),
     "--cpus 4 --units 7 --backend gloo --device cpu"),
]


@pytest.mark.parametrize("opts, text", FORMATTED, ids=[f[1] or "<default>" for f in FORMATTED])
def test_format_options(opts, text):
    assert format_options(opts) == text


@pytest.mark.parametrize("line, expected", VALID, ids=[v[0] or "<empty>" for v in VALID])
def test_format_round_trips(line, expected):
    assert parse_options(format_options(expected)) == expected


# ---------------------------------------------------------------------------------------------
# HELP

FLAG_OF_FIELD = {
    "gpus": "--gpus", "cpus": "--cpus", "units": "--units", "backend": "--backend",
    "device": "--device", "timeout": "--timeout", "show": "--show", "results": "--no-results",
    "config": "--config", "storage": "--storage", "stall": "--stall", "max_restarts": "--max-restarts",
    "cluster": "--cluster", "results_device": "--results-device", "keep": "--keep", "fresh": "--fresh",
    "detach": "--detach", "no_wait": "--no-wait",
}


def test_help_mentions_every_option():
    from dataclasses import fields

    assert {f.name for f in fields(JobOptions)} == set(FLAG_OF_FIELD)
    for flag in FLAG_OF_FIELD.values():
        assert flag in HELP, flag


def test_detach_parses_and_goes_with_keep():
    assert parse_options("--gpus 2 --detach").detach is True
    assert parse_options("--gpus 2").detach is False
    both = parse_options("--detach --keep 30m")
    assert both.detach is True and both.keep == 1800.0


def test_help_says_where_results_come_back():
    text = " ".join(HELP.split())
    assert "--results-device {cpu,keep}" in text
    assert "cpu = on the CPU, so the kernel holds no GPU memory after the job (default)" in text
    assert "keep = on the CUDA device they had on rank 0" in text


def test_help_names_the_magic_and_the_pragma():
    assert HELP.startswith("usage: %%taas ")
    assert "#pragma taas" in HELP
    assert "#!g2.8" in HELP


# ---------------------------------------------------------------------------------------------
# resolve_world

NOTE_CPU = "no CUDA device"

WORLD = [
    # (options line, cuda devices, world, device, backend, note substring or None)
    ("", 0, 1, "cpu", "gloo", NOTE_CPU),
    ("", 1, 1, "cuda", "nccl", None),
    ("", 4, 4, "cuda", "nccl", None),
    ("--gpus 2", 4, 2, "cuda", "nccl", None),
    ("--gpus 4", 4, 4, "cuda", "nccl", None),
    ("--gpus 3", 0, 3, "cpu", "gloo", "3 CPU ranks on gloo"),
    ("--backend nccl", 0, 1, "cpu", "gloo", "1 CPU rank on gloo"),
    ("--backend nccl --gpus 2", 0, 2, "cpu", "gloo", NOTE_CPU),
    ("--backend gloo", 2, 2, "cuda", "gloo", None),
    ("--backend gloo", 0, 1, "cpu", "gloo", NOTE_CPU),
    ("--device cpu", 8, 1, "cpu", "gloo", None),
    ("--device cpu --gpus 4", 8, 4, "cpu", "gloo", None),
    ("--device cpu --gpus 2", 0, 2, "cpu", "gloo", None),
    ("--device cuda", 2, 2, "cuda", "nccl", None),
    ("--device cuda --gpus 1 --backend gloo", 2, 1, "cuda", "gloo", None),
    ("--show 0,1 --gpus 2", 2, 2, "cuda", "nccl", None),
]


@pytest.mark.parametrize("line, cuda, world, device, backend, note", WORLD,
                         ids=[f"{w[0] or '<default>'}@{w[1]}gpu" for w in WORLD])
def test_resolve_world(line, cuda, world, device, backend, note):
    got_world, got_device, got_backend, got_note = resolve_world(parse_options(line), cuda)
    assert (got_world, got_device, got_backend) == (world, device, backend)
    if note is None:
        assert got_note is None
    else:
        assert got_note is not None and note in got_note and "\n" not in got_note


WORLD_ERRORS = [
    ("--device cuda", 0, "--device cuda"),
    ("--device cuda --gpus 2", 0, "--device cuda"),
    ("--gpus 8", 2, "--gpus 8 asks for more GPUs than this machine has (2)"),
    ("--gpus 2 --device cuda", 1, "(1)"),
    ("--show 2 --gpus 2", 2, "--show"),
    ("--show 1", 0, "--show"),
]


@pytest.mark.parametrize("line, cuda, mentions", WORLD_ERRORS,
                         ids=[f"{w[0]}@{w[1]}gpu" for w in WORLD_ERRORS])
def test_resolve_world_errors(line, cuda, mentions):
    with pytest.raises(DirectiveError) as info:
        resolve_world(parse_options(line), cuda)
    assert mentions in str(info.value) and "\n" not in str(info.value)


def test_more_gpus_than_this_machine_has_points_to_a_cluster():
    with pytest.raises(DirectiveError) as info:
        resolve_world(parse_options("--gpus 16"), 8)
    assert "run it on a Ray cluster (%taas cluster ADDRESS, or --cluster ADDRESS)" in str(info.value)
    with pytest.raises(DirectiveError) as info:  # on a cluster, no such advice
        resolve_world(parse_options("--gpus 16"), 8, where="the cluster")
    assert "Ray cluster" not in str(info.value)


@pytest.mark.parametrize("line, cuda, mentions", [
    ("--gpus 8", 4, "--gpus 8 asks for more GPUs than the cluster has (4)"),
    ("--device cuda", 0, "--device cuda but the cluster has no CUDA device"),
])
def test_resolve_world_names_the_cluster(line, cuda, mentions):
    with pytest.raises(DirectiveError) as info:
        resolve_world(parse_options(line), cuda, where="the cluster")
    assert mentions in str(info.value) and "\n" not in str(info.value)


def test_cluster_without_cuda_runs_gloo_with_one_note():
    # A cluster whose nodes advertise GPUs torch cannot see (a simulated cluster): ranks on CPU.
    world, device, backend, note = resolve_world(parse_options("--gpus 4"), 0, where="the cluster")
    assert (world, device, backend) == (4, "cpu", "gloo")
    assert note == "taas: no CUDA device on the cluster: running 4 CPU ranks on gloo"


def test_resolve_world_rechecks_nccl_on_explicit_cpu():
    # JobOptions built directly (not through parse_options) still cannot ask for nccl on CPU.
    with pytest.raises(DirectiveError, match="nccl"):
        resolve_world(JobOptions(backend="nccl", device="cpu"), 4)


# ---------------------------------------------------------------------------------------------
# pragma_transformer


def lines_of(text: str) -> list[str]:
    return text.splitlines(keepends=True)


TRANSFORMED = [
    ("#pragma taas --gpus 2\nx = 1\n",
     "%%taas --gpus 2\nx = 1\n"),
    ("#pragma taas\nx = 1\n",
     "%%taas\nx = 1\n"),
    ("#pragma taas   \nx = 1",  # last line without newline stays so
     "%%taas\nx = 1"),
    ("#  pragma   taas --units 5\nx = 1\n",
     "%%taas --units 5\nx = 1\n"),
    ("# pragma taas --gpus 1\nx = 1\n",
     "%%taas --gpus 1\nx = 1\n"),
    ("#pragma taas --gpus 2",  # the pragma alone, no newline
     "%%taas --gpus 2\n"),
    ("\n\n#pragma taas --gpus 2\nx = 1\ny = 2\n",  # body keeps its line numbers
     "%%taas --gpus 2\n\n\nx = 1\ny = 2\n"),
    ("#!g2.8\n#pragma taas --units 10\nx = 1\n",
     "%%taas --units 10 --config g2.8\n\nx = 1\n"),
    ("#!g2.8\n\n#pragma taas\nx = 1\n",
     "%%taas --config g2.8\n\n\nx = 1\n"),
    ("#!c1.4\n#!g2.8\n#pragma taas --gpus 2\nx = 1\n",  # the last '#!' line wins
     "%%taas --gpus 2 --config g2.8\n\n\nx = 1\n"),
    ("#!g2.8\n#pragma taas --config g1.1\nx = 1\n",  # an explicit --config is kept
     "%%taas --config g1.1\n\nx = 1\n"),
    ("#!g2.8\n#pragma taas --config=g1.1\nx = 1\n",
     "%%taas --config=g1.1\n\nx = 1\n"),
    ("#pragma taas --gpus 2\r\nx = 1\r\n",
     "%%taas --gpus 2\nx = 1\r\n"),
]


@pytest.mark.parametrize("cell, expected", TRANSFORMED, ids=[t[0] for t in TRANSFORMED])
def test_transformer_rewrites(cell, expected):
    out = pragma_transformer(lines_of(cell))
    assert "".join(out) == expected
    assert all(line.endswith("\n") for line in out[:-1])


@pytest.mark.parametrize("cell, expected", TRANSFORMED, ids=[t[0] for t in TRANSFORMED])
def test_transformer_keeps_body_line_numbers(cell, expected):
    before = lines_of(cell)
    after = pragma_transformer(before)
    pragma_at = next(i for i, line in enumerate(before) if PRAGMA_RE.match(line))
    assert len(after) == len(before)
    assert after[1:pragma_at + 1] == ["\n"] * pragma_at
    assert after[pragma_at + 1:] == before[pragma_at + 1:]


def test_transformed_options_parse():
    out = pragma_transformer(lines_of("#!g2.8\n#pragma taas --gpus 2 --units 4\nx = 1\n"))
    assert out[0].startswith("%%taas ")
    assert parse_options(out[0][len("%%taas "):]) == JobOptions(gpus=2, units=4, config="g2.8")


PASSTHROUGH = [
    "",
    "\n\n",
    "x = 1\n",
    "x = 1\ny = 2",
    "%%taas --gpus 2\nx = 1\n",
    "%%taas\n#pragma taas --gpus 2\nx = 1\n",  # already a taas cell: the pragma is a comment
    "%%time\nx = 1\n",
    "#!g2.8\nx = 1\n",  # a DataSphere line without a pragma
    "#!g2.8\n",
    "#pragma once\nx = 1\n",
    "#pragma taasx --gpus 2\nx = 1\n",
    "# taas --gpus 2\nx = 1\n",
    # text inside a string is not a comment, so never a directive
    's = """\n#pragma taas --gpus 2\n"""\n',
    "s = '''\n  # pragma taas\n'''\nx = 1\n",
    'x = 1\ns = """\n#pragma taas --gpus 2\n"""\n',
    'f("""a\n#pragma taas\nb""", 2)\n',
    # prose that starts like a directive is a comment
    "x = 1\n# pragma taas is great\n",
    "# pragma taas is great\nx = 1\n",
    "#pragma taas gpus two\nx = 1\n",
    "x = 1  # pragma taas --gpus 2\n",  # not a whole-line comment
    "%time x = 1\n# pragma taas rocks\n",
    "x = (1,\n",  # does not tokenize: the cell's own SyntaxError will say why
    # the body of a cell magic that is not Python is its own text
    "%%writefile train.py\n#pragma taas --gpus 2\nx = 1\n",
    "%%bash\necho hi\n#pragma taas --gpus 2\n",
]


@pytest.mark.parametrize("cell", PASSTHROUGH)
def test_transformer_passthrough(cell):
    before = lines_of(cell)
    assert pragma_transformer(list(before)) == before


MISPLACED = [
    ("x = 1\n#pragma taas --gpus 2\n", 2),
    ("import torch\n\n\n#pragma taas\nx = 1\n", 4),
    ("%%time\n#pragma taas --gpus 2\nx = 1\n", 2),
    ("# a comment\n#pragma taas\n", 2),
    ("#!g2.8 extra\n#pragma taas\n", 2),  # '#!g2.8 extra' is not a configuration line
    ("#pragma taas --gpus 2\nx = 1\n#pragma taas --gpus 4\n", 3),
    ("x = 1\ny = 2\n    # pragma taas\n", 3),
    ("#!g2.8\nx = 1\n#pragma taas\n", 3),
    ('s = """\n#pragma taas\n"""\n#pragma taas --gpus 2\n', 4),  # after a string: a comment
    ("x = 1\n# pragma taas --gpus 2 --unknown\n", 2),  # options, even wrong ones
    ("%time x = 1\n#pragma taas --gpus 2\n", 2),
    ("def f():\n    # pragma taas\n    return 1\n", 2),
]


@pytest.mark.parametrize("cell, lineno", MISPLACED, ids=[m[0] for m in MISPLACED])
def test_transformer_misplaced_pragma(cell, lineno):
    with pytest.raises(DirectiveError) as info:
        pragma_transformer(lines_of(cell))
    message = str(info.value)
    assert "\n" not in message
    assert "#pragma taas" in message and "first line" in message
    assert f"line {lineno} " in message, message


def test_the_fallback_notes_fact_leaves_out_the_rank_count():
    two = resolve_world(parse_options("--gpus 2"), 0)[3]
    three = resolve_world(parse_options("--gpus 3"), 0)[3]
    one = resolve_world(parse_options(""), 0)[3]
    cluster = resolve_world(parse_options("--gpus 2"), 0, where="the cluster")[3]
    assert note_fact(two) == note_fact(three) == note_fact(one) != note_fact(cluster)
    assert note_fact(two) == "taas: no CUDA device here: running CPU ranks on gloo"


def test_no_wait_is_off_unless_asked():
    assert parse_options("--gpus 2").no_wait is False
    assert parse_options("--gpus 2 --no-wait").no_wait is True
