"""Everything about the notebook's working directory: the storage rule, merging layers back, copies on other nodes.

May import ``taas.errors`` and ``taas.io`` (the one spelling and order of process names)."""
