"""The one-machine data transport: shared-memory rings."""
