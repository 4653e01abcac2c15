"""What the tests share, never tests themselves: harnesses (a real kernel, a simulated Ray
cluster, a second launcher, a kernel-less Ray driver), forked children, and the helpers and
cells several test modules use.  A test module imports from here (or gets a conftest.py
fixture), never from another test module (tests/project/test_tests.py checks it).

May import taas and the standard library, psutil, pytest, jupyter_client; never tests outside
this folder."""
