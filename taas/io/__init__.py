"""Text for the notebook: the kernel-side output pump, failure rendering, progress lines."""
