"""The env-host daemon: EnvManagers (one asyncio task per trajectory), the
partial-trajectory journal, prompt claims.

Threads:
- main (Daemon loop): registration; each cycle reads the live rollouts
  (`members/rollout/*` → `addresses.requests`) and reward-hosts
  (`members/reward-host/*` → `addresses.trajectories`) from etcd and hands them on;
- env loop (`EnvRunner`): claims prompts through etcd (CAS on prompts/cursor), runs
  the EnvManagers, journals every finished turn and trajectory;
- outbox (`OutboxThread`): sends finished trajectories — dropped ones too, with
  `dropped_reason`, so the trainer can account for them — to the reward-hosts, keyed
  by trajectory id, until acked; acks are journaled.

The journal lives at `$RLFLEET_RUN_DIR/env-host/<id>.jsonl` (else
`<runs_dir>/<job>/env-host/<id>.jsonl`): restart with the same `--id` to resume it.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

from rlfleet.common.control.members import Member, members_from
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.daemon import Daemon
from rlfleet.common.spec.seams import ENV_ROUTERS
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.outbox import OutboxThread
from rlfleet.daemons.tasks.prompts import PromptStream, task_from_spec

from .claims import PromptClaimer
from .journal import TrajectoryJournal, journal_path, launched_per_prompt
from .manager import ManagerConfig, TurnCodec
from .pacing import ClaimPacer, pacer_for
from .routing_policy import RolloutTraits
from .runner import EnvRunner

log = logging.getLogger("rlfleet.env_host")

DRAIN_ACK_WAIT_S = 3.0  # on SIGTERM, how long to wait for acks of finished trajectories
SETUP_RETRY_S = 10.0
BINDINGS_EVERY_S = 2.0  # the routing counts in etcd: fresh enough to read, few writes


def peer_addresses(members: list[Member], address_name: str) -> dict[str, str]:
    """{member id: address} of running members that publish `address_name` (a member
    that states no state counts as running, as before states existed)."""
    out = {}
    for m in members:
        address = m.address(address_name)
        if m.state in ("running", "") and address:
            out[m.id] = address
    return out


def rollout_traits(members: list[Member], live: dict[str, str]) -> dict[str, RolloutTraits]:
    """What the routing policy knows of each live rollout from its record: its hardware
    label and slots (sequences it decodes at once)."""
    out = {}
    for m in members:
        if m.id in live:
            slots = m.info.get("slots")
            out[m.id] = RolloutTraits(str(m.info.get("hardware") or ""),
                                      slots if isinstance(slots, int) and slots > 0 else None)
    return out


def _rollouts_sentence(rollouts: dict[str, str]) -> str:
    if len(rollouts) > 8:  # a simulated fleet: hundreds of ids say nothing
        return f"rollouts: {len(rollouts)}"
    return f"rollouts: {', '.join(sorted(rollouts)) or 'none'}"


class EnvHost(Daemon):
    role = "env-host"

    runner: EnvRunner | None = None
    pacer: ClaimPacer | None = None
    setup_error = ""

    def setup(self) -> None:
        self._peers: tuple[dict[str, str], dict[str, str]] = ({}, {})
        self._versions: dict[str, int] = {}
        self._retry_setup_at = 0.0
        said = self._try_start()
        if said:
            (log.error if self.setup_error else log.info)(said, extra={"event": "setup"})

    def _try_start(self) -> str | None:
        """Build the data path; a model folder without a usable tokenizer (or a bad task
        difficulty) keeps the daemon registered and saying why, retried every 10 s."""
        assert self.spec is not None
        spec, member_id = self.spec, self.options.member_id
        self._retry_setup_at = time.monotonic() + SETUP_RETRY_S
        try:
            task = task_from_spec(spec)
            codec = TurnCodec.from_model_dir(str(spec.model.path))
            journal = TrajectoryJournal(journal_path(spec, member_id), launched_per_prompt(spec))
        except Exception as exc:  # noqa: BLE001 — reported in the registration and the log
            error = f"cannot start: {type(exc).__name__}: {exc}"[:300]
            changed, self.setup_error = error != self.setup_error, error
            return error if changed else None
        self.setup_error = ""
        self.journal = journal
        if self.pacer is not None:
            self.pacer.stop()
        self.pacer = pacer_for(spec, self.store, self.keys, on_progress=lambda: self.runner and self.runner.wake(),
                               weights_seen=lambda: self.runner.newest_weights if self.runner else 0)
        self.claimer = PromptClaimer(self.store, self.keys, member_id,
                                     budget=self.pacer.budget if self.pacer else None)
        self.outbox = OutboxThread(f"{member_id}->reward-host", on_acked=self._on_acked)
        self.routing = ENV_ROUTERS.build(spec.env_host.routing, name=member_id)
        self.runner = EnvRunner(
            task=task, stream=PromptStream(task, spec.job.seed), codec=codec,
            config=ManagerConfig.from_spec(spec), group_size=spec.task.group_size,
            max_concurrent=spec.env_host.max_concurrent, journal=self.journal,
            claim=self.claimer.claim, recent_claims=self.claimer.recent,
            submit=self._submit, name=member_id,
            routing=self.routing, env_mode=spec.env_host.env_mode,
            redundant_samples=spec.env_host.redundant_samples,
            redundant_prompts=spec.env_host.redundant_prompts)
        # Everything built so far (transformers and torch modules, the tokenizer: several
        # hundred thousand objects) lives as long as the process. Out of the collector's
        # sight, a full collection walks only what the data path allocates: each one
        # cost ~0.1 s of CPU while the loop stood still.
        gc.freeze()
        self.outbox.start()
        self.runner.start()
        if self.pacer is not None:
            self.pacer.start()
        live = len(self.journal.live_prompts())
        # The metrics URL and pid: where tools/bench/env_scale.py finds the loop lag and CPU.
        return (f"env loop started (journal {self.journal.path}, {live} live prompts, "
                f"metrics {self.metrics_url or 'off'}, pid {os.getpid()})")

    def _submit(self, key: str, traj: Trajectory) -> None:
        self.outbox.submit(key, traj)

    def _on_acked(self, acked: list[tuple[str, bool, str]]) -> None:
        assert self.runner is not None  # the outbox starts after the runner exists
        self.runner.on_acked(acked)

    def cycle(self) -> str | None:
        if self.runner is None:
            return self._try_start() if time.monotonic() >= self._retry_setup_at else None
        if not self.runner.alive():
            self.request_stop()  # the supervisor restarts us; the journal resumes the work
            return f"env loop died ({self.runner.error!r}); stopping"
        try:
            rollout_members = self._members("rollout")
            rollouts = peer_addresses(rollout_members, "requests")
            reward_hosts = peer_addresses(self._members("reward-host"), "trajectories")
        except StoreUnavailable:
            return None  # the session already said "etcd unreachable"; keep the current peers
        versions = {m.id: v for m in rollout_members
                    if isinstance(v := m.info.get("weight_version"), int) and m.id in rollouts}
        said = []
        fleet = rollout_traits(rollout_members, rollouts)
        if fleet != self.routing.fleet:
            self.routing.set_fleet(fleet)
        self._publish_bindings()
        if rollouts != self._peers[0] or versions != self._versions:
            self.runner.set_rollouts(rollouts, versions)
            self._versions = versions
        if rollouts != self._peers[0]:
            said.append(_rollouts_sentence(rollouts))
        if reward_hosts != self._peers[1]:
            self.outbox.set_addresses(list(reward_hosts.values()))
            said.append(f"reward-hosts: {', '.join(sorted(reward_hosts)) or 'none'}")
        self._peers = (rollouts, reward_hosts)
        return "; ".join(said) or None

    def _publish_bindings(self) -> None:
        """The routing policy's bindings (the affinity kind's prefer table) and live counts
        per tag and hardware, under routing/<our id>, at most every BINDINGS_EVERY_S."""
        now = time.monotonic()
        if self.session is None or now < getattr(self, "_bindings_at", 0.0):
            return
        self._bindings_at = now + BINDINGS_EVERY_S
        bindings = {"kind": self.spec.env_host.routing.kind, **self.routing.bindings()}  # type: ignore[union-attr]
        if bindings != getattr(self, "_bindings", None):
            self.session.put_lease_bound(self.keys.routing(self.options.member_id), bindings)
            self._bindings = bindings

    def _members(self, role: str) -> list[Member]:
        return members_from(self.keys, self.store.get_prefix(self.keys.role_members_prefix(role)))

    def drain(self) -> str | None:
        if self.runner is None:
            return None
        self.runner.stop()
        if self.pacer is not None:
            self.pacer.stop()
        deadline = time.monotonic() + DRAIN_ACK_WAIT_S
        while self.outbox.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        unacked = self.outbox.pending
        self.outbox.stop()
        self.outbox.join(5.0)
        self.journal.close()
        return (f"stopped {self.runner.in_flight} trajectories in flight, {unacked} unacked "
                f"(journaled, resumed on restart)")

    def member_info(self) -> dict[str, Any]:
        runner = self.runner
        if runner is None:
            return {"error": self.setup_error} if self.setup_error else {}
        first = runner.first_acked_at
        return {"in_flight": runner.in_flight, "claimed": runner.claimed, "done": runner.acked,
                **({"first_done_at": round(first, 3)} if first is not None else {}),
                "claim_limit": self.pacer.limit if self.pacer else None}
