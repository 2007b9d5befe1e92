"""Fixtures of the reward-host tests that more than one module uses."""

from __future__ import annotations

from typing import Any

import pytest

from rlfleet.daemons.reward_host.remote.backend import RemoteBackend
from rlfleet.daemons.reward_host.remote.config import RemoteHttpConfig


@pytest.fixture
def backends():
    built: list[RemoteBackend] = []

    def build(**config: Any) -> RemoteBackend:
        built.append(RemoteBackend(RemoteHttpConfig(**config), seed=1))
        return built[-1]

    yield build
    for b in built:
        b.close()
