"""One relay's data plane (`RelayNode`) as its own process, without etcd, for tests that
measure the process (its memory) or talk to it over raw sockets.

    python -m tests.relay.node_proc STORE_DIR [MAX_OBJECT_BYTES]

Prints {"address": ..., "pid": ...} on stdout, logs to stderr, reads the job secret
from RLFLEET_JOB_SECRET_FILE like the daemon, and stops when stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from rlfleet.common.job_secret import job_secret_from_env
from rlfleet.relay.admission import DEFAULT_MAX_OBJECT_BYTES
from rlfleet.relay.node import NodeConfig, RelayNode


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_MAX_OBJECT_BYTES
    node = RelayNode(NodeConfig("relay-t", sys.argv[1], max_object_bytes=limit,
                                secret=job_secret_from_env())).start()
    print(json.dumps({"address": node.address, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    node.stop()


if __name__ == "__main__":
    main()
