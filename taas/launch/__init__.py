"""Starting and supervising a job's processes (contract in api.py)."""
