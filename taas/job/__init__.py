"""What travels with a job, both ways, as values: the Job itself (api), namespace analysis,
packaging and what crosses (package, crossing), where tensors land when they cross (devices: a
notebook CUDA value on the rank's own GPU, results on the CPU), and rank 0's results (results:
the format of ``result.pkl`` for both ends, and which names a cell bound at run time), IPython
syntax in a cell (syntax: the magics a rank has, the calls routed to the rank's shell).  Pure:
no processes, no IPython; it may import taas.errors and taas.job.memory only.
"""
