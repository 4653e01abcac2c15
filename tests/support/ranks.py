"""Reading a cell's output as each rank printed it.

taas shows a line that several ranks print identically once, tagged with those ranks
(``[rank0-1] done``, ``[rank1,3] odd``).  A test that asserts "rank 1 printed X" reads the
output through :func:`per_rank`, which writes such a line back as one tagged line per rank, so
that the assertion holds whether or not the line collapsed.
"""

from __future__ import annotations

import re

_TAG = re.compile(r"^\[rank([\d,-]+)\] ", re.MULTILINE)


def ranks_of(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    ranks: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def per_rank(text: str) -> str:
    """``text`` with each collapsed line written once per rank: ``[rank0-1] x`` becomes
    ``[rank0] x`` and ``[rank1] x`` (lines tagged with one rank, or not at all, stay)."""
    out = []
    for line in text.splitlines(keepends=True):
        match = _TAG.match(line)
        if match is None or match.group(1).isdigit():
            out.append(line)
            continue
        rest = line[match.end():]
        if not rest.endswith("\n"):
            rest += "\n"  # a last line without its newline: the copies must not run together
        out.extend(f"[rank{r}] {rest}" for r in ranks_of(match.group(1)))
    return "".join(out)
