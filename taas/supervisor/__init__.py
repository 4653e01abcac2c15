"""Watching one started job to its end: the state machine, the run loop, the diagnosis."""
