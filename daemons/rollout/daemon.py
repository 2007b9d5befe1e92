"""The rollout daemon: an inference engine with continuous batching, serving generation requests.

setup() loads the model of spec.model.path into the engine named by
spec.rollout.engine (through the engine registry), binds a RequestServer (published as ``addresses["requests"]``)
and starts two threads:

- ``rollout-engine`` (``loop.EngineLoop``; ``sim-host``, ``sim_host.SimHost``, for
  simulated rollouts): owns the engine and the socket, serves, loads weight versions;
- ``rollout-relay`` (``relay_source.RelayFollower``): finds this host's relay in etcd
  and, when it dies or another takes its place, builds the reader for the new one and
  swaps it in once it works; the engine thread only picks up the current reader.

The main loop (``common.daemon``) refreshes the lease and runs cycle(), which only
reports what those threads did (weight-version changes, relay switches) and notices if
the engine thread died: nothing on it waits for a relay or a weight load. Weight
versions come from the local relay through ``rlfleet.relay.reader.WeightReader``;
without that module the rollout serves version 0, the checkpoint on disk.

Torch threads: ``torch.set_num_threads`` from RLFLEET_TORCH_THREADS (default 1). Whoever
starts several daemons on one machine sets it so that the torch threads of all of
them together do not exceed the machine's cores.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rlfleet.common.daemon import Daemon
from rlfleet.common.devices import torch_device
from rlfleet.common.wire.messages import Abort, GenerateRequest, RepackOrder, RolloutStats
from rlfleet.common.wire.sockets import RequestServer

log = logging.getLogger("rlfleet.rollout")

THREADS_ENV = "RLFLEET_TORCH_THREADS"
EXPECT = (GenerateRequest, Abort, RolloutStats, RepackOrder)  # what a rollout's socket serves


def torch_threads(environ: dict[str, str] | None = None) -> int:
    """The torch intra-op thread count from RLFLEET_TORCH_THREADS (default 1)."""
    raw = (os.environ if environ is None else environ).get(THREADS_ENV, "1").strip() or "1"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {n}")
    return n


class Rollout(Daemon):
    role = "rollout"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop: Any = None  # EngineLoop, once set up
        self.server: RequestServer | None = None
        self.sim: Any = None  # SimHost, when this process hosts simulated rollouts
        self._sim_published: dict[str, int] = {}  # simulated rollout -> version in its record
        self._sim_traits: dict[str, dict[str, Any]] = {}  # simulated rollout -> hardware, slots
        self.hardware = ""  # a real rollout's: its node's label "hardware" (affinity routing)
        self.follower: Any = None  # RelayFollower (relay_source.py), None without the relay package

    def setup(self) -> None:
        assert self.spec is not None
        if self.spec.rollout.engine.kind == "sim":
            self._setup_sim()
            return
        import torch  # here, not at import: `rlfleet daemon --help` stays instant

        from rlfleet.common.spec.seams import ROLLOUT_ENGINES

        from .loop import EngineLoop

        assert self.spec is not None
        threads = torch_threads()
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)  # the engine runs one op at a time
        except RuntimeError:
            pass  # already set in this process
        rs = self.spec.rollout
        engine = ROLLOUT_ENGINES.build(rs.engine, model_path=self.spec.model.path,
                                       dtype=self.spec.model.dtype, device=torch_device())  # its GPUs, if given
        self.server = RequestServer(f"tcp://{rs.bind_host}:0",
                                    expect=EXPECT,
                                    name=f"{self.options.member_id}-requests", edge="rollout-requests")
        self.addresses["requests"] = self.server.endpoint
        self.follower = self._follow_relay()
        self.loop = EngineLoop(engine, self.server, self.options.member_id, self.follower, mode=rs.mode)
        self.loop.start()
        self.hardware = self._node_hardware()
        log.info("serving %s on %s: engine %s, max_batch %d, cache %d tokens/slot, %d torch thread(s)",
                 self.spec.model.path, self.server.endpoint, rs.engine.kind, getattr(engine, "max_batch", 0),
                 getattr(engine, "max_len", 0), threads, extra={"event": "serving"})

    def _setup_sim(self) -> None:
        """Many simulated rollouts in this process (sim_host.py), each its own member."""
        from rlfleet.common.spec.run_dir import job_run_dir
        from rlfleet.common.spec.seams import ROLLOUT_ENGINES
        from rlfleet.daemons.rollout.sim.host import SimHost, bind_servers, sim_member_id

        from .core import RolloutCore, limit_vocab

        assert self.spec is not None
        rs, host_id = self.spec.rollout, self.options.member_id
        count = rs.engine.rollouts  # type: ignore[attr-defined]
        fleet = rs.engine.fleet()  # type: ignore[attr-defined]  # (hardware label, config) each
        servers = bind_servers(count, rs.bind_host, host_id, EXPECT)
        cores = []
        for k, (server, (hardware, config)) in enumerate(zip(servers, fleet)):
            member_id = sim_member_id(host_id, k, count)
            engine = ROLLOUT_ENGINES.build(config, model_path=self.spec.model.path,
                                           dtype=self.spec.model.dtype, rollout_index=k,
                                           seed=self.spec.job.seed)
            limit_vocab(server, engine)
            cores.append(RolloutCore(engine, member_id, where=server.name, mode=rs.mode))
            self._sim_traits[member_id] = {"hardware": hardware, "slots": config.timing().max_batch}
        self.follower = self._follow_relay()
        self.sim = SimHost(cores, servers, self.follower,
                           summary_path=job_run_dir(self.spec) / "sim" / f"{host_id}.json")
        self.sim.start()
        log.info("hosting %d simulated rollouts (%s, profile %s, time scale %g)", count, rs.mode,
                 rs.engine.profile, rs.engine.time_scale, extra={"event": "serving"})  # type: ignore[attr-defined]

    def _publish_sim_members(self) -> str | None:
        """Register each simulated rollout (bound to this daemon's lease) and keep its
        weight version current in its record (at most once per cycle)."""
        if self.session is None or self.session.lease is None:
            return None
        loaded = 0
        for core, server in zip(self.sim.cores, self.sim.servers):
            version = core.engine.weight_version
            if self._sim_published.get(core.member_id) == version:
                continue
            first = core.member_id not in self._sim_published
            self.session.put_lease_bound(self.keys.member("rollout", core.member_id), {
                "id": core.member_id, "role": "rollout", "host": self.options.host,
                "pid": os.getpid(), "state": "running",
                "addresses": {"requests": server.endpoint},
                "started": round(self.started_at, 3), "weight_version": version,
                "simulated_by": self.options.member_id, **self._sim_traits[core.member_id]})
            self._sim_published[core.member_id] = version
            loaded += not first
        return f"{loaded} simulated rollouts loaded a newer version" if loaded else None

    def _node_hardware(self) -> str:
        """This machine's hardware label: ``labels.hardware`` of its node record (the agent's
        ``--labels``), '' when it has none or etcd does not answer."""
        from rlfleet.common.control.members import Node

        try:
            kv = self.store.get(self.keys.node(self.options.host))
            return "" if kv is None else Node.from_kv(self.keys, kv).labels.get("hardware", "")
        except Exception:  # noqa: BLE001 — a label is a routing hint, never a reason not to serve
            return ""

    def _follow_relay(self) -> Any:
        """Start the rollout-relay thread (relay_source.py); None when this installation
        has no relay reader."""
        try:
            from rlfleet.relay.reader import WeightReader

            from .relay_source import RelayFollower
        except ImportError as exc:
            log.warning("no weight reader (%s): serving weight version 0, the checkpoint on disk",
                        exc, extra={"event": "no_reader"})
            return None
        job, host = self.options.job, self.options.host
        follower = RelayFollower(self.store, job, host, lambda relay: WeightReader(
            self.store, job, host, relay_id=relay.id, shm_dir=relay.shm_dir), on_switch=self.wake)
        follower.start()
        return follower

    def _relay_said(self) -> list[str]:
        said = []
        while self.follower is not None and self.follower.events:
            said.append(self.follower.events.popleft())
        return said

    def release(self) -> None:
        """Let the next weight load happen now; running requests end as "abort"."""
        if self.loop is not None:
            self.loop.release()
        if self.sim is not None:
            self.sim.release()

    def cycle(self) -> str | None:
        if self.sim is not None:
            if not self.sim.alive and self.sim.error is not None:
                raise RuntimeError(f"sim host thread died: {self.sim.error!r}")
            for core in self.sim.cores:
                core.events.clear()  # versions are summarised below, not logged per rollout
            return "; ".join(filter(None, [*self._relay_said(), self._publish_sim_members()])) or None
        if self.loop is None:
            return None
        if not self.loop.alive and self.loop.error is not None:
            # Exit non-zero so the supervisor restarts a clean process: nothing is lost,
            # env-hosts re-issue the turns this rollout held.
            raise RuntimeError(f"engine thread died: {self.loop.error!r}")
        said = self._relay_said()
        while self.loop.events:
            said.append(self.loop.events.popleft())
        return "; ".join(said) or None

    def member_info(self) -> dict[str, Any]:
        relay = self.follower.relay if self.follower is not None else None
        reading = {"relay": relay.id} if relay is not None else {}  # whose store it reads weights from
        if self.sim is not None:
            return {"simulated_rollouts": len(self.sim.cores), **reading}
        if self.loop is None:
            return {"weight_version": 0}
        core = self.loop.core
        first, weights = core.first_result_at, core.first_weights
        slots = getattr(self.loop.engine, "max_batch", None)
        return {"weight_version": self.loop.engine.weight_version, "hardware": self.hardware, **reading,
                **({"slots": slots} if isinstance(slots, int) else {}),
                **({"first_weights_at": round(weights[0], 3), "first_weights_version": weights[1]}
                   if weights is not None else {}),
                **({"first_result_at": round(first, 3)} if first is not None else {})}

    def drain(self) -> str | None:
        if self.follower is not None:
            self.follower.stop(timeout_s=1.0)  # a daemon thread: a lookup in flight need not end
        if self.sim is not None:
            self.sim.stop()
            for server in self.sim.servers:
                server.close()
            return f"{len(self.sim.cores)} simulated rollouts stopped"
        if self.loop is None:
            return None
        self.loop.stop()
        stats = self.loop.engine.stats()
        if self.server is not None:
            self.server.close()
        return f"engine stopped at weight version {stats.weight_version}"
