"""The Ray launcher: a job's ranks on a Ray cluster's GPU nodes, loader workers on its CPU nodes.

One job per module: ``launcher`` (:class:`RayLauncher`, the Launcher contract), ``cluster``
(the Ray connection and the pool of node agents), ``reservation`` (the GPUs a job holds, as a
placement group), ``job`` (:class:`RayJob`, one attempt's handle over its nodes' agents),
``copies`` (the working directory's copies on nodes that do not see it), ``agent`` (the actor
on each node: a warm local launcher), ``node_watch`` (what an ended agent leaves behind),
``placement`` (pure: which node runs what).

May import: ``taas.errors``, ``taas.shield``, ``taas.ready``, ``taas.io``, the launcher contract
(``taas.launch``), ``taas.launch.process``, the local launcher (``taas.launch.local``: its
``launcher`` and ``jobdir`` only) and ``taas.workdir``; never the data plane or the rank
runtime (the session joins them).  Ray itself is imported only where a cluster is used.
"""
