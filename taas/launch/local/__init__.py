"""The local launcher: a warm start process forks a job's processes on this machine.

Kernel side: ``launcher`` (LocalLauncher: warm start, checks, start), ``job`` (LocalJob, the
JobHandle), ``limits`` (open files, GPUs).  The wire between the two: ``protocol`` (typed
messages, both ends).  Below the kernel: ``guard`` (the process the kernel starts), ``starter``
(the start process that forks jobs), ``child`` (a forked child before its entry point), ``unix``
(the process calls they share), ``forksafe`` (the start process never forks with CUDA
initialised: checked before every fork), ``forkstart`` (a warm job host forks its guard and
start process instead of starting a fresh interpreter).  ``jobdir``: a job's directory on this machine.

May import: taas.errors, taas.shield, taas.launch (the contract), taas.launch.process and
taas.workdir (the storage rule a child applies); never the data plane or the rank runtime (the
session joins them; the start process preloads ``taas.rank.main`` by name only).
"""
