"""Unit tests of taas.host's viewer side (client.py): a recorded stream (LogWriter, RecordSink)
replayed onto a fake sink; taking, loading and refusing results.  No host process, no torch job."""
