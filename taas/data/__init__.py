"""The data plane: registered loaders iterated by loader workers, units streamed to the ranks.

    notebook                kernel (plane.py)                    job processes
    taas.register(loader)   registry.py: checks, keeps it
    %%taas --cpus M --units K
                            plan: which loaders the cell reads,
                            K, prefetch (plan.py: pure numbering)
                            loader.pkl, shm segment, fifos  -->  loader:NAME:w  (worker.py, M of them)
                                                                   units u = w, w+M, ... (source.py)
                                                                   | put(u, batch)   transport.py: contract
                                                                   v                 shm.py: rings in /dev/shm
                                                                 rankR: NAME is a view (view.py)
                                                                   each `for` = one pass's share
                            progress, summary  <-- events ---    (units ready, waited, bytes)

Unit u is element u mod L of pass u // L (L: the loader's length); worker u mod M produces it
and rank u mod N consumes it.  A unit's content depends only on u and the job's seed, never on
M, so the same units reach the same ranks whatever the number of loader workers.

Nothing here imports torch at import time except the modules that run inside job processes
(source, shm, view, worker); ``import taas`` stays cheap.
"""
