"""A CURVE client in a process of its own, holding one role's key pair:

    python -m tests.security.edge_probe SECRET_FILE ADDRESS [TIMEOUT_S]

connects to a published ADDRESS (``tcp://host:port?curve=<server key>``) and prints what
the server's ZAP handler decided, read from the client socket's own handshake events:
``admitted``, ``refused (<event>)``, or ``no answer``. No message is sent either way.
"""

from __future__ import annotations

import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

from rlfleet.common.wire import curve

EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "admitted",
          zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused (auth)",
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused (protocol)",
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused (no detail)"}


def probe(secret_file: str, address: str, timeout_s: float) -> str:
    pair = dict(curve._CERT_KEY.findall(open(secret_file, "rb").read()))
    plain, server_key = curve.split(address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_publickey, sock.curve_secretkey = pair[b"public"], pair[b"secret"]
    sock.curve_serverkey = server_key
    monitor = sock.get_monitor_socket(sum(EVENTS))
    try:
        sock.connect(plain)
        if not monitor.poll(int(timeout_s * 1000)):
            return "no answer"
        return EVENTS.get(recv_monitor_message(monitor)["event"], "other")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    print(probe(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 10.0), flush=True)
