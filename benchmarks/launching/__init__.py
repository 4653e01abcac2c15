"""The parts of ``benchmarks/launch.py`` (the script and its CLI stay there): ``job`` (the
4-rank DDP job, torchrun's run and taas's), ``values`` (a big notebook value to the ranks,
a big result back), ``kernels`` (a trivial cell through real kernels, taas vs nbdistributed).
Benchmarks only: taas never imports these."""
