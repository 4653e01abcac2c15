"""Unit tests of taas.jobs, the job records on disk: the store, the bounded output log, the table.

Files in a tmp folder only; a process of its own where a test needs the record's lock held by
another process (a job host's part), killed by its pid at the test's end."""
