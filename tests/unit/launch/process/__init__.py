"""Unit tests of taas.launch.process: events, report, stacks (what a launched process may use).

They import taas.launch.process and tests/support only; what needs a process of its own runs in
a forked child (tests.support.forks)."""
