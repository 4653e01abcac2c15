"""Unit tests of taas.rank, the rank runtime: comm, display, patches.

They import taas.rank and tests/support only; anything that changes torch for good (patches, a
process group) runs in a forked child (tests.support.forks)."""
