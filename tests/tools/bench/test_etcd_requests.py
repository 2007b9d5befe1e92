"""tools/bench/etcd_requests reads a real etcd's /metrics: requests per method, streams by message."""

from __future__ import annotations

import urllib.request

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.tools.bench.etcd_requests import parse_metrics, report


def _scrape(endpoint: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode())


def test_requests_are_counted_per_method_and_keepalives_per_message(etcd):
    endpoint = etcd.members[0].endpoint
    with EtcdStore(etcd.endpoints) as store:
        lease = store.grant_lease(30)
        first = _scrape(endpoint)
        for i in range(3):
            store.get("/x")
            store.put("/x", i)
            store.refresh_lease(lease)  # one stream, three messages
        last = _scrape(endpoint)
    result = report(first, last, 2.0)
    assert result["requests"]["Put"] == 3 and result["requests"]["LeaseKeepAlive"] == 3
    assert result["requests"]["Range"] >= 3  # the scrape itself is no gRPC request
    assert result["requests_per_s"]["Put"] == 1.5
    assert result["raft_proposals"] >= 3  # each put is one
