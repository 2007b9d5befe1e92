"""The etcd key layout (ARCHITECTURE §6) — the one place key names are spelled.

Every value under these keys is JSON, so `etcdctl get --prefix /rlfleet/<job>/`
is readable by an operator without Python. Keys are part of the operator
interface: change them only with a migration note in docs/operations/etcd-keys.md.

    /rlfleet/<job>/spec                            the job spec, as submitted
    /rlfleet/<job>/owner                           the `rlfleet run` running the job: incarnation, host, pid (lease)
    /rlfleet/<job>/nodes/<host>                    machine inventory, labels, daemons: its node agent (lease)
    /rlfleet/<job>/members/<role>/<id>             live daemons: addresses, host, pid, state (lease)
    /rlfleet/<job>/leader/<role>                   elections: {"id": ..., "since": ...} (lease)
    /rlfleet/<job>/term/<role>                     the last leader's fencing term: {term, reign, id, since}
    /rlfleet/<job>/placement/<host>/<role>/<id>    desired daemons per machine
    /rlfleet/<job>/weights/latest                  {version, bytes, checksum, master}
    /rlfleet/<job>/relay/chain                     {master, order: [relay ids], layouts, updated}
    /rlfleet/<job>/relay/master                    the master relay: {id, since, newest} (lease)
    /rlfleet/<job>/relay/layouts/tp<k>             shard layouts readers asked for
    /rlfleet/<job>/prompts/cursor                  claimed prompt ranges
    /rlfleet/<job>/trainer/checkpoint              last checkpoint: version, path
    /rlfleet/<job>/trainer/progress                groups trained or dropped (paces claims)
    /rlfleet/<job>/state                           running | paused (maintenance): `rlfleet pause/resume`
    /rlfleet/<job>/node_state/<host>               cordoned | draining | drained | removed: `rlfleet node ...`
    /rlfleet/<job>/admitted/<host>                 the resource-manager's admission of a host into a pool
    /rlfleet/<job>/switchover/<role>               a requested leadership handover: {to, from, by, at} (lease)
    /rlfleet/<job>/routing/<env-host id>           routing bindings (affinity prefer table), counts per tag/hardware (lease)

The values are parsed in one place too: `common/control/records.py` (one typed,
immutable record per key) and `common/control/cluster.py` (the whole job at once).
"""

from __future__ import annotations

import re

from rlfleet.common.job_name import JOB_NAME_RULE, is_job_name

ROOT = "/rlfleet"
ROOT_PREFIX = f"{ROOT}/"  # every job's keys, for tools that list the jobs in an etcd

# Key names relative to a job's prefix (also the labels parse problems name keys by).
SPEC = "spec"
OWNER = "owner"
NODES = "nodes"
MEMBERS = "members"
LEADER = "leader"
TERM = "term"
PLACEMENT = "placement"
WEIGHTS_LATEST = "weights/latest"
RELAY = "relay"
RELAY_CHAIN = "relay/chain"
RELAY_MASTER = "relay/master"
RELAY_LAYOUTS = "relay/layouts"
PROMPTS_CURSOR = "prompts/cursor"
TRAINER_CHECKPOINT = "trainer/checkpoint"
TRAINER_PROGRESS = "trainer/progress"
REPACK_PLAN = "repack/plan"
STATE = "state"
NODE_STATE = "node_state"
ADMITTED = "admitted"
SWITCHOVER = "switchover"
ROUTING = "routing"

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _check(component: str, what: str) -> str:
    # A '/' or empty component would silently alias another key; refuse it early.
    if not _COMPONENT.match(component):
        raise ValueError(f"invalid {what} for an etcd key component: {component!r}")
    return component


class JobKeys:
    """Key names for one job. Build once per daemon: `keys = JobKeys("demo")`."""

    def __init__(self, job: str) -> None:
        if not is_job_name(job):  # every key of the job starts with it: the stricter rule, here too
            raise ValueError(f"invalid job name {job!r}: {JOB_NAME_RULE}")
        self.job = job
        self.prefix = f"{ROOT}/{job}/"

    # -- whole-job -------------------------------------------------------
    @property
    def spec(self) -> str:
        return f"{self.prefix}{SPEC}"

    @property
    def owner(self) -> str:
        """The one `rlfleet run` that runs this job (created only if absent, lease-bound)."""
        return f"{self.prefix}{OWNER}"

    @property
    def state(self) -> str:
        """The job's operating state: running, or paused for maintenance (`rlfleet pause`)."""
        return f"{self.prefix}{STATE}"

    # -- the live fleet: operator intent and admission (docs/operations/live-fleet.md) ----
    @property
    def node_states_prefix(self) -> str:
        return f"{self.prefix}{NODE_STATE}/"

    def node_state(self, host: str) -> str:
        """What the operator asked of a host (cordon, drain, remove); absent: schedulable."""
        return f"{self.node_states_prefix}{_check(host, 'host')}"

    @property
    def admitted_prefix(self) -> str:
        return f"{self.prefix}{ADMITTED}/"

    def admitted(self, host: str) -> str:
        """The resource-manager's admission of a host that the spec does not name into a pool."""
        return f"{self.admitted_prefix}{_check(host, 'host')}"

    @property
    def switchovers_prefix(self) -> str:
        return f"{self.prefix}{SWITCHOVER}/"

    def switchover(self, role: str) -> str:
        """A requested handover of a singleton's leadership to a named standby (lease-bound)."""
        return f"{self.switchovers_prefix}{_check(role, 'role')}"

    # -- liveness (lease-bound) -----------------------------------------
    @property
    def nodes_prefix(self) -> str:
        return f"{self.prefix}{NODES}/"

    def node(self, host: str) -> str:
        return f"{self.nodes_prefix}{_check(host, 'host')}"

    @property
    def members_prefix(self) -> str:
        return f"{self.prefix}{MEMBERS}/"

    def role_members_prefix(self, role: str) -> str:
        return f"{self.members_prefix}{_check(role, 'role')}/"

    def member(self, role: str, member_id: str) -> str:
        return f"{self.role_members_prefix(role)}{_check(member_id, 'member id')}"

    @property
    def leaders_prefix(self) -> str:
        return f"{self.prefix}{LEADER}/"

    def leader(self, role: str) -> str:
        return f"{self.leaders_prefix}{_check(role, 'role')}"

    def term(self, role: str) -> str:
        """The fencing term of a failsafe role's last leader (docs/operations/failsafe.md); no lease."""
        return f"{self.prefix}{TERM}/{_check(role, 'role')}"

    # -- desired state ---------------------------------------------------
    @property
    def placement_prefix(self) -> str:
        return f"{self.prefix}{PLACEMENT}/"

    def host_placement_prefix(self, host: str) -> str:
        return f"{self.placement_prefix}{_check(host, 'host')}/"

    def placement(self, host: str, role: str, member_id: str) -> str:
        return f"{self.host_placement_prefix(host)}{_check(role, 'role')}/{_check(member_id, 'member id')}"

    @property
    def repack_plan(self) -> str:
        """The repack-manager's last plan: id, moves, state (executing | done)."""
        return f"{self.prefix}{REPACK_PLAN}"

    # -- weights, prompts, checkpoints -----------------------------------
    @property
    def weights_latest(self) -> str:
        return f"{self.prefix}{WEIGHTS_LATEST}"

    @property
    def relay_prefix(self) -> str:
        """Everything the relays coordinate through (chain, master, layouts)."""
        return f"{self.prefix}{RELAY}/"

    @property
    def relay_chain(self) -> str:
        return f"{self.prefix}{RELAY_CHAIN}"

    @property
    def relay_master(self) -> str:
        return f"{self.prefix}{RELAY_MASTER}"

    @property
    def relay_layouts_prefix(self) -> str:
        return f"{self.prefix}{RELAY_LAYOUTS}/"

    def relay_layout(self, tp: int) -> str:
        if type(tp) is not int or tp < 1:
            raise ValueError(f"invalid layout for an etcd key: {tp!r} (a tensor-parallel degree >= 1)")
        return f"{self.relay_layouts_prefix}tp{tp}"

    @property
    def routing_prefix(self) -> str:
        return f"{self.prefix}{ROUTING}/"

    def routing(self, env_host_id: str) -> str:
        """An env-host's routing bindings and live counts per tag and hardware (lease-bound)."""
        return f"{self.routing_prefix}{_check(env_host_id, 'member id')}"

    @property
    def prompts_cursor(self) -> str:
        return f"{self.prefix}{PROMPTS_CURSOR}"

    @property
    def trainer_checkpoint(self) -> str:
        return f"{self.prefix}{TRAINER_CHECKPOINT}"

    @property
    def trainer_progress(self) -> str:
        return f"{self.prefix}{TRAINER_PROGRESS}"

    # -- parsing ---------------------------------------------------------
    def parse_member(self, key: str) -> tuple[str, str]:
        """'/rlfleet/j/members/<role>/<id>' -> (role, id)."""
        rest = key.removeprefix(self.members_prefix)
        role, _, member_id = rest.partition("/")
        if rest == key or not role or not member_id or "/" in member_id:
            raise ValueError(f"not a member key of job {self.job!r}: {key!r}")
        return role, member_id

    def parse_leader(self, key: str) -> str:
        """'/rlfleet/j/leader/<role>' -> role."""
        return self._last_component(key, self.leaders_prefix, "leader")

    def parse_node(self, key: str) -> str:
        """'/rlfleet/j/nodes/<host>' -> host."""
        return self._last_component(key, self.nodes_prefix, "node")

    def _last_component(self, key: str, prefix: str, what: str) -> str:
        rest = key.removeprefix(prefix)
        if rest == key or not rest or "/" in rest:
            raise ValueError(f"not a {what} key of job {self.job!r}: {key!r}")
        return rest

    def parse_node_state(self, key: str) -> str:
        """'/rlfleet/j/node_state/<host>' -> host."""
        return self._last_component(key, self.node_states_prefix, "node state")

    def parse_admitted(self, key: str) -> str:
        """'/rlfleet/j/admitted/<host>' -> host."""
        return self._last_component(key, self.admitted_prefix, "admission")

    def parse_switchover(self, key: str) -> str:
        """'/rlfleet/j/switchover/<role>' -> role."""
        return self._last_component(key, self.switchovers_prefix, "switchover")

    def parse_placement(self, key: str) -> tuple[str, str, str]:
        """'/rlfleet/j/placement/<host>/<role>/<id>' -> (host, role, id)."""
        parts = key.removeprefix(self.placement_prefix).split("/")
        if not key.startswith(self.placement_prefix) or len(parts) != 3 or not all(parts):
            raise ValueError(f"not a placement key of job {self.job!r}: {key!r}")
        return parts[0], parts[1], parts[2]


def job_of(key: str) -> str | None:
    """The job a key belongs to ('/rlfleet/<job>/...' -> job), None for keys outside ROOT."""
    job, sep, _ = key.removeprefix(ROOT_PREFIX).partition("/")
    if not key.startswith(ROOT_PREFIX) or not sep or not _COMPONENT.match(job):
        return None
    return job
