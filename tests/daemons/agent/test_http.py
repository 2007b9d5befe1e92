"""The agent's HTTP endpoint: /targets in Prometheus http_sd shape, /metrics, 404 otherwise."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from rlfleet.common.control.members import Member
from rlfleet.daemons.agent import http


def member(role: str, mid: str, host: str, metrics: str) -> Member:
    return Member.parse(role, mid, {"id": mid, "role": role, "host": host, "metrics": metrics})


def test_targets_are_the_metrics_endpoints_of_this_hosts_daemons_but_not_of_agents():
    members = [member("rollout", "rollout-0", "h1", "http://10.0.0.1:41523/metrics"),
               member("relay", "relay-0", "h2", "http://10.0.0.2:40000/metrics"),  # another host
               member("agent", "h1", "h1", "http://10.0.0.1:9464/metrics"),      # scraped on its own
               member("trainer", "trainer-0", "h1", "")]                           # no endpoint
    assert http.http_sd_groups("arith", "h1", members) == [
        {"targets": ["10.0.0.1:41523"], "labels": {"job": "arith", "host": "h1", "role": "rollout", "id": "rollout-0"}}]


def test_the_server_answers_targets_metrics_and_404():
    doc = [{"targets": ["127.0.0.1:1"], "labels": {"job": "j", "host": "h"}}]
    server = http.serve("127.0.0.1", 0, lambda: doc)
    base = f"http://127.0.0.1:{server.port}"
    try:
        with urllib.request.urlopen(base + "/targets", timeout=10) as r:
            assert r.headers["Content-Type"] == "application/json" and json.loads(r.read()) == doc
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            assert b"# HELP" in r.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/other", timeout=10)
        assert err.value.code == 404
    finally:
        server.close()
