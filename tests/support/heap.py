"""glibc's heap, for tests of memory that must be its own mapping (a resident move needs one)."""

from __future__ import annotations

import ctypes


def mmapped_floats() -> int:
    """A float32 count whose allocation glibc mmaps: more than its main heap's free space.
    glibc serves a big request from a free heap chunk when one is large enough, and after
    earlier tests freed memory there even 40 MiB can come from the heap (taas then copies such
    memory instead of moving it)."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks",
                                                          "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:  # glibc before 2.33
        return (40 << 20) // 4
    mallinfo2.restype = MallInfo2
    nbytes = max(40 << 20, mallinfo2().fordblks + (8 << 20))
    return -(-nbytes // (1 << 20)) * (1 << 20) // 4  # whole MiB
