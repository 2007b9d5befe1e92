"""Run inside a lab host (the job's venv, its env file loaded): send the reward-host one
hostile but decodable trajectory — a prompt whose seed is past int64 — with the host's
env-host CURVE key (the role the reward-host's socket admits), and print the reward-host's answer as JSON. Exit 0 when it was refused
with a reason, 1 when it was taken, 2 when no answer came. Used by
tests/deploy/test_live_fleet.py::test_runbook_poisoned_input (docs/operations/runbook.md).

    python poison_reward_host.py JOB
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec

from rlfleet.common.control.etcd_auth import EtcdCredentials, open_store
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import members_from
from rlfleet.common.wire import curve
from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import Trajectory, Turn
from rlfleet.common.wire.reliable import ReliableSender
from rlfleet.daemons.tasks import get_task


def main(job: str) -> int:
    curve.configure_from_env(role="env-host")
    store = open_store(os.environ["RLFLEET_ETCD"], creds=EtcdCredentials.from_env())
    keys = JobKeys(job)
    reward_hosts = members_from(keys, store.get_prefix(keys.role_members_prefix("reward-host")))
    sender = ReliableSender(reward_hosts[0].address("trajectories"), resend_after_s=5.0)
    prompt = get_task("arithmetic").make_prompts("train", 1)[0]
    poisoned = msgspec.structs.replace(prompt, seed=2**64 - 1)
    turn = Turn(Int32Array([1, 5, 6]), Int32Array([7, 2]), Float32Array([-0.5, -0.1]), 0, poisoned.question, "7")
    t = Trajectory("poison-0", 10**9, "poison", poisoned.task, [turn], 0.0, {}, "", prompt=poisoned)
    sender.send(t.trajectory_id, t)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sender.poll(0.1)
        for key, ok, error in sender.take_acked():
            print(json.dumps({"key": key, "ok": ok, "error": error}))
            return 1 if ok else 0
    print(json.dumps({"ok": None, "error": "no answer within 30 s"}))
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
