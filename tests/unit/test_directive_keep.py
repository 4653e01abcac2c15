"""--keep [LIMIT] and --fresh: parsing, the usage errors, and the round trip."""

import math

import pytest

from taas.directive import KEEP_DEFAULT, format_options, parse_options
from taas.errors import DirectiveError


@pytest.mark.parametrize("line, keep", [
    ("--gpus 2 --keep", KEEP_DEFAULT),
    ("--keep --gpus 2", KEEP_DEFAULT),
    ("--keep 90s", 90.0),
    ("--keep 30m", 1800.0),
    ("--keep 2h", 7200.0),
    ("--keep 2.5", 2.5),
    ("--gpus 2", None),
])
def test_keep_limits(line, keep):
    assert parse_options(line).keep == keep


@pytest.mark.parametrize("line", ["--keep 0s", "--keep soon", "--keep 3d", "--keep infh"])
def test_bad_keep_limits_are_one_line_errors(line):
    with pytest.raises(DirectiveError, match="--keep") as info:
        parse_options(line)
    assert "\n" not in str(info.value)


def test_keep_with_max_restarts_is_a_usage_error():
    with pytest.raises(DirectiveError, match="--keep cannot be combined with --max-restarts"):
        parse_options("--gpus 2 --keep --max-restarts 1")
    assert parse_options("--gpus 2 --keep --max-restarts 0").keep == KEEP_DEFAULT


def test_fresh():
    assert parse_options("--fresh").fresh
    assert not parse_options("").fresh


@pytest.mark.parametrize("line", ["--keep", "--keep 30m", "--fresh --gpus 2", "--keep 1.5 --fresh"])
def test_round_trip(line):
    opts = parse_options(line)
    assert parse_options(format_options(opts)) == opts


def test_default_is_no_limit():
    assert math.isinf(KEEP_DEFAULT)
