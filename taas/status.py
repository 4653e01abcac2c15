"""``%taas``: what taas sees here and what the last job did, as text."""

from __future__ import annotations


def render(session) -> str:
    # Where the next cell runs: this machine's GPUs, or the cluster's nodes, GPUs and CPUs.
    address = session.cluster_address()
    lines = session.launcher_for(address).describe()
    if address is None and hasattr(session, "gpu_lines"):  # this machine's GPUs and their leases
        lines += session.gpu_lines()
    try:
        from taas.data.registry import registered

        names = registered()
        lines.append("registered loaders: " + (", ".join(names) if names else "none"))
    except ImportError:
        pass
    kept = getattr(session, "kept", None)
    if kept is not None and kept.handle is not None:
        lines.append(kept.describe())
    last = session.last
    if last is None:
        lines.append("last job: none yet")
    else:
        lines.append(
            f"last job {last.job_id}: {last.outcome}, {last.world_size} rank(s) on "
            f"{last.device}/{last.backend}, {last.wall_s:.2f} s"
            + (f", restarts {last.restarts}" if getattr(last, "restarts", 0) else "")
            + (f", DataSphere configuration #!{last.config}" if last.config else "")
            + (f", on the Ray cluster at {last.cluster}" if getattr(last, "cluster", None) else "")
        )
        codes = ", ".join(f"{k}={v}" for k, v in sorted(last.exit_codes.items()))
        if codes:
            lines.append(f"  exit codes: {codes}")
        if getattr(last, "results", ""):
            lines.append(f"  big results: {last.results}")
        for line in getattr(last, "data", []):  # the data plane's figures, one line per loader
            lines.append("  " + line.removeprefix("taas: "))
    return "\n".join(lines)
