"""The cross-machine data transport: TCP streams into per-node relays that fill the ranks'
shared-memory rings (the contract: :mod:`taas.data.transport`).

    transport.py   TcpTransport (kernel: the hub, control queries, clean-up)
    relay.py       a GPU node's relay (a job process)
    endpoint.py    a loader worker's streams; a rank's node-local rings
    wire.py        secret, handshake, frames, message framing
    messages.py    the hub's typed JSON messages
    nodes.py       which node a rank is on; a node's segment and FIFO names, their removal

May import: ``taas.errors``, ``taas.ready`` (poll(2)), ``taas.io``, the data plane's core (``taas.data``), the
shared-memory transport (``taas.data.shm``) and ``taas.launch`` / ``taas.launch.process``
(ProcessSpec for the relays, error reports); never a launcher or the rank runtime.
"""
