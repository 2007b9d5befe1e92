"""Relay-chain fixtures: real etcd (tests/conftest.py), real relay processes."""

from __future__ import annotations

import pytest

from tests.relay.fleet import RelayFleet


@pytest.fixture
def fleet(etcd, tmp_path):
    f = RelayFleet(etcd.members[0].endpoint, tmp_path)
    yield f
    f.close()
