"""Everything about the notebook's working directory: the storage rule, merging layers back, copies on other nodes.

May import ``taas.errors``, ``taas.io`` (the one spelling and order of process names) and
``taas.shield`` (a Ctrl-C never leaves a clock file in the notebook's folder)."""
