"""Everything about the notebook's working directory: the storage rule, merging layers back, copies on other nodes."""
