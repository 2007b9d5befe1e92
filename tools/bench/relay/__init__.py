"""Relay-chain benchmark: pipelined chain vs store-and-forward vs gloo broadcast vs the raw link.

    python -m rlfleet.tools.bench.relay --size-mib 256,1024 --relays 1,2,4,8 --json OUT
    python -m rlfleet.tools.bench.relay plot OUT [OUT2 ...] --png FIG.png

Every relay is its own process (a `RelayNode`, the relay daemon's data plane,
without etcd: the coordinator hands it the chain); the coordinator plays the
trainer and pushes each version to relay 0. With root and `ip netns`, each
relay runs in its own network namespace behind a veth pair on one bridge (a
stand-in for machines); otherwise everything runs on loopback and the summary
says so.

Output: a JSON list of records {method, transport, p, size_bytes, chunk_bytes,
seconds, ...} with method in chain | store_forward | gloo | link (`seconds`:
from the trainer's first byte to the last relay holding the whole version;
chain records also carry `stall_s`, the trainer's wait), and a summary next to
it (OUT with .summary.json) with T(p)/T(1), the Appendix C fit
T(p, k) = (p + k - 1)(M/k T_byte + T_start) (p relays plus the trainer = p + 1
nodes), the repair time after a relay is killed mid-broadcast, and the machine
it ran on (`--machine` names it; cores, CPU model, memory are read).
If the namespaces cannot be set up (no `ip`, no veth or bridge in the kernel),
the run falls back to loopback and the summary says why.

`plot` draws seconds vs p per method and the trainer's stall vs p, one row per
version size, from record files (a plain list, or {"records": [...]}). A record
marked {"excluded": why} afterwards is kept in the file but left out of medians,
fits and plots.

With RLFLEET_JOB_SECRET_FILE set, every hop (and the trainer's link) is
authenticated (relay.auth): run it with and without to see what that costs.
"""
