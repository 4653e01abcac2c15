"""GPU leases on one machine: every job holds the GPUs it uses for as long as its ranks live.

``api`` (what a GPU, a holder, a place in line and a decision are: plain data), ``decide``
(pure: "GPUs seen, leases held, requests waiting" -> take these GPUs, or wait, and the lines
that say so), ``locks`` (the lock directory: one ``flock``-ed file per GPU, held open by the
processes that use it, and the first-come-first-served queue), ``inventory`` (this machine's
GPUs by UUID: NVML, else torch; ``CUDA_VISIBLE_DEVICES`` honoured), ``wait`` (a job's wait for
its GPUs: the line updated in place, ``--no-wait``, an interrupt starts nothing).

May import: taas.errors only.  The session joins it to a job (the lease's fds go to every
process of the job as shared fds, its GPUs to the ranks as ``CUDA_VISIBLE_DEVICES``).
"""
