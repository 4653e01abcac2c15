"""The data plane: registered loaders iterated by loader workers, units streamed to the ranks.

    notebook                kernel: plane.py                      job processes
    taas.register(loader)   registry.py: checks, keeps it
    %%taas --cpus M --units K
                            which registered loaders the cell
                            reads, K, prefetch (plan.py: pure)
                            loader pickle, channels            -> loader:NAME:w  (loader_worker.py,
                            (the session's pick of transport:       M of them)
                            transport.py, the contract;             units u = w, w+M, ...  (source.py)
                            shm/ on one machine, tcp/ across        | put(u, batch)
                            machines)                               v   the transport's channels
                                                                  rankR: NAME is a view  (view.py)
                                                                    each `for` = one pass's share
                            progress, summary  <--- events ----   (messages.py: typed; units
                                                                   ready, waited, bytes)

Unit u is an element of a pass over the loader, numbered pass after pass; worker u mod M
produces it and rank u mod N consumes it.  A unit's content depends only on u and the job's
seed, never on M, so the same units reach the same ranks whatever the number of loader workers.

``import taas`` imports none of this; :mod:`taas.data.registry` (what ``taas.register`` is) needs
no torch, the modules that run in job processes import it.

May import: ``taas.errors``, ``taas.io``, ``taas.job``, ``taas.launch`` (the contract) and
``taas.launch.process`` (events, report) -- never a launcher, the rank runtime or its own
transports (``shm/``, ``tcp/``: named by ``"module:Class"`` strings and resolved at run time),
so that a new transport needs no change here.  Every channel here ignores, and logs on the
``taas`` logger, a message it cannot read.
"""
