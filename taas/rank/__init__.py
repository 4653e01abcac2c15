"""The rank runtime: what runs inside each rank process (the cell body, the process group, display, patches)."""
