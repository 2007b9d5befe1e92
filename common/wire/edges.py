"""Who may send to whom: the role-to-socket edges that CURVE enforces (docs/operations/security.md).

Every daemon role has its own CURVE key pair, and ``authorized/<role>/*.key`` says which
role a public key speaks for. A server socket names its edge (``RequestServer(...,
edge=...)``); the ZAP handler of its process admits a client only when the client's key
belongs to a role the edge lists. So a compromised env-host can still send what an
env-host sends, but can no longer pose as a reward-host to the trainer, nor a rollout to
anyone. Policy only: common/wire/curve.py applies it, this module never touches a socket.
"""

from __future__ import annotations

DOMAIN = b"rlfleet"  # the ZAP domain of a server socket that names no edge: any authorized key

# edge (the server socket) -> the roles whose keys it admits
EDGES: dict[str, frozenset[str]] = {
    "trainer-trajectories": frozenset({"reward-host"}),               # scored trajectories
    "reward-host-trajectories": frozenset({"env-host"}),              # finished trajectories
    "rollout-requests": frozenset({"env-host", "repack-manager"}),    # generate, abort, stats, repack
}

# The roles that connect to some edge: a daemon of these must hold its own role's key.
SENDERS: frozenset[str] = frozenset().union(*EDGES.values())


def domain(edge: str) -> bytes:
    """The ZAP domain a server socket of ``edge`` carries (libzmq hands it to ZAP)."""
    if edge and edge not in EDGES:
        raise ValueError(f"unknown socket edge {edge!r}; known: {', '.join(sorted(EDGES))}")
    return DOMAIN + b"/" + edge.encode() if edge else DOMAIN


def edge_of(zap_domain: bytes) -> str | None:
    """The edge a ZAP request's domain names; None for a socket that names none.
    Raises ValueError for a domain this module did not make (fail closed)."""
    if zap_domain == DOMAIN:
        return None
    head, _, edge = zap_domain.partition(b"/")
    name = edge.decode(errors="replace")
    if head != DOMAIN or name not in EDGES:
        raise ValueError(f"unknown ZAP domain {zap_domain!r}")
    return name


def admits(edge: str | None, role: str) -> bool:
    """Whether a client whose key speaks for ``role`` ("" for a key without a role) may
    connect to a socket of ``edge`` (None: a socket that names no edge admits any key)."""
    return edge is None or role in EDGES[edge]
