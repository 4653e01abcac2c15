"""The rank runtime: what runs inside each worker process."""
