"""The ``taas`` logger's debug trail: there when the user turns it on, silent otherwise."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from taas.job import package


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def trail():
    """A handler on the ``taas`` logger; the test sets the level."""
    logger = logging.getLogger("taas")
    handler, level = Capture(), logger.level
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _double(x):
    return 2 * x


def test_packaging_leaves_a_debug_trail_when_enabled(trail):
    logging.getLogger("taas").setLevel(logging.DEBUG)
    blob = package.ship({"n": 3, "double": _double})
    lines = [(r.name, r.getMessage()) for r in trail.records]
    assert ("taas.job.package", "shipping 2 value(s): n (int), double (function)") in lines, lines
    assert ("taas.job.package", f"payload pickle: {len(blob)} bytes; large arrays in shared memory: 0 bytes") in lines


def test_no_trail_by_default(trail):
    logging.getLogger("taas").setLevel(logging.NOTSET)  # as after `import taas`: inherits WARNING
    package.ship({"n": 3, "double": _double})
    assert trail.records == []


def test_ranks_log_only_when_the_kernel_asked_for_it(trail):
    def payload():
        return package.Payload(source="", filename="<cell>", first_line=1, names=b"", bound=(),
                               device="cpu", backend="gloo", pg_timeout=1.0)

    logging.getLogger("taas").setLevel(logging.NOTSET)
    assert payload().log_level is None  # the rank adds no handler: silent
    logging.getLogger("taas").setLevel(logging.DEBUG)
    assert payload().log_level == logging.DEBUG  # the rank logs to its stderr, i.e. the cell


def test_nothing_is_printed_without_a_handler():
    # A fresh process, as a rank or a kernel is: taas's NullHandler keeps even warnings from
    # Python's last-resort handler, and taas configures no logging of its own.
    code = textwrap.dedent("""
        import logging
        import taas.rank.main
        from taas.job import package
        package.ship({"n": 3})
        logging.getLogger("taas.rank.main").warning("must not be printed")
        logging.getLogger("taas.job.package").debug("must not be printed")
        assert logging.getLogger().handlers == [], logging.getLogger().handlers
        assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("taas").handlers)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
