"""The Ray launcher: a job's ranks on a Ray cluster's GPU nodes, loader workers on its CPU nodes."""
