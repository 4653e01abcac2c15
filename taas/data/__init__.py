"""The data plane: registered loaders iterated by loader workers, units streamed to the ranks.

    notebook                kernel: plane.py                      job processes
    taas.register(loader)   registry.py: checks, keeps it
    %%taas --cpus M --units K
                            which registered loaders the cell
                            reads, K, prefetch (plan.py: pure)
                            loader pickle, channels            -> loader:NAME:w  (worker.py, M of them)
                            (the launcher's transport:              units u = w, w+M, ...  (source.py)
                            transport.py, the contract;             | put(u, batch)
                            shm_transport.py on one machine)        v   shm.py: pooled blocks
                                                                  rankR: NAME is a view  (view.py)
                                                                    each `for` = one pass's share
                            progress, summary  <--- events ----   (units ready, waited, bytes)

Unit u is an element of a pass over the loader, numbered pass after pass; worker u mod M
produces it and rank u mod N consumes it.  A unit's content depends only on u and the job's
seed, never on M, so the same units reach the same ranks whatever the number of loader workers.

``import taas`` imports none of this; :mod:`taas.data.registry` (what ``taas.register`` is) needs
no torch, the modules that run in job processes import it.
"""
