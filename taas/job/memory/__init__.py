"""Big notebook values in shared memory: resident tensors moved there and sent by descriptor,
other big arrays and device storages' host copies written once (bigvalues, files, resident).
May import taas.errors only."""
