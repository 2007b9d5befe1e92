"""One relay of the benchmark's chain: a process the coordinator starts (`worker`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

MIB = 1 << 20


def worker_main(args: argparse.Namespace) -> int:
    """One relay process, driven by JSON lines on stdin (replies on stdout)."""
    from rlfleet.common.job_secret import job_secret_from_env
    from rlfleet.relay.node import NodeConfig, RelayNode
    from rlfleet.relay.topology import ChainView, RelayMember

    node = RelayNode(NodeConfig(args.id, args.store_dir, transport=args.transport, bind_host=args.bind,
                                window_chunks=args.window, keep_versions=1,
                                store_and_forward=args.store_and_forward, secret=job_secret_from_env())).start()
    out = sys.stdout

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply({"address": node.address})
    pg = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "chain":
            members = {rid: RelayMember(rid, "", addr, "", -1, "running", 1.0) for rid, addr in cmd["addresses"].items()}
            node.set_chain(ChainView(cmd["order"][0], tuple(cmd["order"]), members))
            reply({"ok": True})
        elif op == "wait":
            deadline = time.monotonic() + cmd["timeout"]
            obj = None
            while time.monotonic() < deadline:
                obj = node.store.get((cmd["version"], 1))
                if obj is not None and obj.complete:
                    break
                time.sleep(0.002)
            done = obj is not None and obj.complete
            reply({"ok": done, "completed_wall": obj.completed_wall if done else None})
        elif op == "clear":  # free every version, so the next rep starts from an empty store
            with node.store.cond:
                for key, obj in list(node.store.objects.items()):
                    if obj.refs == 0 and node.store._try_free(obj):
                        del node.store.objects[key]
            reply({"ok": True})
        elif op == "stats":
            reply(node.stats())
        elif op == "gloo":
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            if pg is None:
                dist.init_process_group("gloo", init_method=cmd["init"], rank=cmd["rank"], world_size=cmd["world"])
                pg = True
            buf = torch.empty(cmd["size"], dtype=torch.uint8)
            ends = []
            for _ in range(cmd["reps"]):
                dist.barrier()
                dist.broadcast(buf, src=0)
                ends.append(time.time())
            reply({"ends": ends})
        elif op == "sink":
            import socket

            srv = socket.socket()
            srv.bind((args.bind, 0))
            srv.listen(1)
            reply({"address": srv.getsockname()})
            conn, _ = srv.accept()
            buf = bytearray(cmd["size"])
            view, got = memoryview(buf), 0
            while got < len(buf):
                got += conn.recv_into(view[got:], min(len(buf) - got, 8 * MIB))
            reply({"done_wall": time.time()})
            conn.close()
            srv.close()
        elif op == "quit":
            break
    node.stop()
    return 0
