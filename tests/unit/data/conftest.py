"""Fixtures of the data-plane unit tests."""

import pytest

from taas.data import registry


@pytest.fixture
def registered():
    """``registered(value, **kw)``: ``taas.register`` for this test only."""
    made = []

    def register(value, **kw):
        registry.register(value, **kw)
        made.append(value)
        return value

    yield register
    for value in made:
        registry.unregister(value)
