"""The local launcher: a warm start process forks a job's processes on this machine."""
