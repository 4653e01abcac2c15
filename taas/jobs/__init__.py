"""Job records: what a user's detached jobs leave on disk, and the only code that reads or writes it.

A detached job (``--detach``) runs under a job host process (:mod:`taas.host`) that outlives the
kernel; everything a later notebook or a terminal needs to see the job is in its record folder:

    <root>/<id>/   0700, the user's own
      record.json    the JobRecord (api.py), replaced atomically (write, fsync, rename)
      lock           flock'd by the job's host for its whole life: free while the record
                     says running means the host is gone (the record reads ``lost``)
      job.pkl        the Job the kernel prepared (taas.host.api.Prepared), until the host took it
      out/           the output log, bounded (log.py): the first and the latest records
      view.json      what is shown in place now: open progress bars, the rank panel, the plot
      results.pkl    rank 0's names and Out[] until a notebook takes them (once)

A viewer waits for the folder's next change (watch.py, inotify) rather than looking at a period.

Pure file operations: no processes are started here, nothing imports IPython or torch.
May import: taas.errors, taas.io (how sizes are written), taas.ready (poll(2)).
"""
