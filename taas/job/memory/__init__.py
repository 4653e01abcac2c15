"""Big notebook values: resident tensors moved to shared memory, sent by descriptor."""
