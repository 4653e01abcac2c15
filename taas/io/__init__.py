"""Framed output: the kernel-side output pump and failure rendering."""
