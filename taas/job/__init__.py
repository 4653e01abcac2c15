"""What travels with a job, both ways, as values: the Job itself (api), namespace analysis,
packaging and what crosses (package, crossing), where tensors land when they cross (devices: a
notebook CUDA value on the rank's own GPU, results on the CPU), and rank 0's results (results:
the format of ``result.pkl`` for both ends).  Pure: no processes, no IPython; it may import
taas.errors and taas.job.memory only.
"""
