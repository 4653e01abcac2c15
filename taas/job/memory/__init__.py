"""Big notebook values in shared memory: resident tensors moved there and sent by descriptor,
other big arrays and device storages' host copies written once (bigvalues, files, resident).
May import taas.errors, taas.shield (an interrupt never cuts the results channel in half) and
taas.ready (poll(2)) only."""
