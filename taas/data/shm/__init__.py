"""The one-machine data transport: shared-memory rings (the contract: :mod:`taas.data.transport`).

    transport.py   ShmTransport (kernel: header segments, FIFOs, clean-up), ShmEndpoint
    ring.py        a channel's two ends: ShmSender (loader worker), ShmReceiver (rank)
    block.py       a channel's formats: FIFO messages, block header
    segment.py     a loader's header segment (control words), the segment names and their
                   removal by whole name (never another attempt's), FIFOs

May import: ``taas.errors``, ``taas.ready`` (poll(2)) and the data plane's core
(``taas.data``); nothing of the launchers or of the TCP transport, which builds on this one.
"""
