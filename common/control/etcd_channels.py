"""How rlfleet's pyetcd clients hold their gRPC channels: which errors mean "this member did
not answer", how long a failed member is skipped, and what becomes of a failed member's
channel. `EtcdStore` and its watches build every client here."""

from __future__ import annotations

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

# Errors that mean "this endpoint did not answer", as opposed to a logic error.
UNREACHABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    etcd_exc.WatchTimedOut,
    grpc.RpcError,
    ValueError,  # pyetcd raises ValueError when the endpoint in use was marked failed
)

# A failed endpoint is skipped for this long. pyetcd's default is 300 s, which
# would keep a single-endpoint client offline for 5 minutes after one blip.
ENDPOINT_RETRY_S = 1.0

# A channel no call has used for this long drops its connection (gRPC's default: 30 min).
# The channel in use is never idle (every daemon cycle calls etcd; a lease or watch stream
# counts as a call); this bounds what any other channel holds.
CHANNEL_IDLE_TIMEOUT_MS = 60_000


def _channel_options() -> list[tuple[str, int]]:
    return [("grpc.client_idle_timeout_ms", CHANNEL_IDLE_TIMEOUT_MS)]


def new_client(endpoints: list[tuple[str, int]], tls: grpc.ChannelCredentials | None,
               timeout_s: float) -> pyetcd.MultiEndpointEtcd3Client:
    eps = [pyetcd.Endpoint(h, p, secure=tls is not None, creds=tls, time_retry=ENDPOINT_RETRY_S,
                           opts=_channel_options()) for h, p in endpoints]
    client = pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)
    # Use endpoints in the order given (pyetcd picks one at random), so an
    # operator's list order means "preferred first" and tests are repeatable.
    client._current_endpoint_label = eps[0].netloc
    return client


def renew_failed_channels(client: pyetcd.MultiEndpointEtcd3Client) -> None:
    """Give each endpoint marked failed since its last renewal a new, unconnected channel.
    The old channel would reconnect in the background once its member is back and hold an
    unused socket: one per member a process ever failed over from (fds 11 -> 13 after six
    member losses; a soak's daemons rose 10 -> 12 with etcd's faults). pyetcd has already
    dropped its stubs on the old channel when it marked the endpoint failed."""
    for ep in client.endpoints.values():
        if ep.is_failed() and getattr(ep, "renewed_after", None) != ep.last_failed:
            ep.channel.close()
            ep.channel = ep._mkchannel(_channel_options())
            ep.renewed_after = ep.last_failed
