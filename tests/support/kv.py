"""A dict for a Ray cluster's key-value store (taas.host.ray.store's RayKV calls), for tests."""

from __future__ import annotations


class DictKV:
    """The cluster's key-value store as internal_kv behaves: keys listed by prefix, a delete
    says how many keys it removed."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def get(self, name):
        return self.data.get(name)

    def put(self, name, value):
        self.data[name] = bytes(value)

    def delete(self, name, by_prefix=False):
        gone = [k for k in self.data if (k.startswith(name) if by_prefix else k == name)]
        for k in gone:
            del self.data[k]
        return len(gone)

    def keys(self, prefix):
        return [k for k in self.data if k.startswith(prefix)]
