"""The cross-machine data transport: TCP streams into per-node relays."""
