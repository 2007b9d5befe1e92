"""`rlfleet pause` and `rlfleet resume`: the job's maintenance mode (docs/operations/maintenance-mode.md).

`pause` writes `state` = paused (who, when, why) and waits until the fleet says it
took effect: the trainer leader holds at a step boundary with its version
checkpointed (`paused: true` and `checkpoint_version == version` in its member
record), and every node agent observes only (`paused: true` in `nodes/<host>`).
`resume` writes `state` = running and waits until no trainer and no node reports
paused any more. Either one, when not confirmed within --timeout, exits 10 with
the request left in effect.

Exit codes (tools/exit_codes.py OPERATOR_CODES): 0 done (or already so), 3 etcd
unreachable, 9 refused (no spec for the job: nothing there to pause), 10 timed out.
"""

from __future__ import annotations

import getpass
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import click

from rlfleet.tools.ctl.etcd_options import _fail_unreachable, _pick_job, _store, etcd_option, job_name
from rlfleet.tools.exit_codes import Exit

DEFAULT_TIMEOUT_S = 120.0  # a step in progress, then a checkpoint: minutes on a big model
POLL_S = 0.25              # three small reads per poll (trainer members, its leader, nodes)


@dataclass(frozen=True)
class Seen:
    """One look at what the fleet reports about the pause."""

    trainer: Any       # the trainer leader's Member, or None (none elected, or no trainer in the spec)
    wants_trainer: bool  # the spec places a trainer
    nodes: tuple[Any, ...]  # every node agent's record (common/control/members.py Node)

    @property
    def trainer_paused(self) -> bool:
        """Held at a step boundary with its current version checkpointed."""
        if not self.wants_trainer:
            return True
        info = self.trainer.info if self.trainer is not None else {}
        return info.get("paused") is True and info.get("checkpoint_version") == info.get("version")

    @property
    def paused(self) -> bool:
        return self.trainer_paused and all(n.paused for n in self.nodes)

    @property
    def resumed(self) -> bool:
        trainer = self.trainer is not None and self.trainer.info.get("paused") is True
        return not trainer and not any(n.paused for n in self.nodes)

    def trainer_line(self) -> str:
        if not self.wants_trainer:
            return "no trainer in the spec"
        if self.trainer is None:
            return "no trainer leader registered"
        i = self.trainer.info
        return (f"trainer {self.trainer.id}: {i.get('training', '?')} at step {i.get('version', '?')} "
                f"(checkpoint version {i.get('checkpoint_version', '?')})")

    def hosts(self, paused: bool) -> list[str]:
        return sorted(n.host for n in self.nodes if n.paused == paused)


def look(store, keys, wants_trainer: bool) -> Seen:
    from rlfleet.common.control.members import Leader, Member, Node

    leader_kv = store.get(keys.leader("trainer"))
    leader = Leader.from_kv(keys, leader_kv).id if leader_kv is not None else ""
    trainer = next((m for kv in store.get_prefix(keys.role_members_prefix("trainer"))
                    if (m := Member.from_kv(keys, kv)).id == leader and leader), None)
    nodes = tuple(Node.from_kv(keys, kv) for kv in store.get_prefix(keys.nodes_prefix))
    return Seen(trainer, wants_trainer, nodes)


def operator_name() -> str:
    """Who asked, for the state record: user@host of this command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container)
        user = "?"
    return f"{user}@{socket.gethostname()}"


def open_job(etcd: str, job: str | None):
    """(store, keys, spec, its JobState or None) of the job; exit 9 when etcd holds no
    spec for it, 3 when etcd cannot be reached."""
    from rlfleet.common.control.cluster import read_spec
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.operations import JobState
    from rlfleet.common.control.store import StoreUnavailable
    from rlfleet.common.spec.errors import SpecError

    store = _store(etcd)
    try:
        job = _pick_job(store, job)
        keys = JobKeys(job)
        try:
            spec = read_spec(store, keys)
        except SpecError as exc:
            spec, bad = None, f": {exc}"
        else:
            bad = ""
        current = JobState.read(store, keys)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    if spec is None:
        click.echo(f"refused: no valid spec for job {job} at {keys.spec}{bad} (nothing there to pause "
                   "or resume; `rlfleet job submit` writes one)", err=True)
        sys.exit(Exit.REFUSED)
    return store, keys, spec, current


def _not_confirmed(command: str, timeout_s: float, seen: Seen | None, hosts_line: Callable[[Seen], str],
                   lifted_by: str = "") -> NoReturn:
    """Exit 10: what was last seen (the trainer, then ``hosts_line`` of it) when the
    timeout ran out; the command's record stays in effect."""
    pending = "nothing readable" if seen is None else f"{seen.trainer_line()}; {hosts_line(seen)}"
    click.echo(f"rlfleet {command}: not confirmed within {timeout_s:g} s ({pending}); the {command} stays in "
               f"effect{lifted_by}", err=True)
    sys.exit(Exit.TIMED_OUT)


def _wait(store, keys, wants_trainer: bool, done: str, timeout_s: float) -> tuple[Seen | None, float]:
    """Poll until `Seen.<done>` holds; (the last look, seconds waited)."""
    return poll_until(lambda: look(store, keys, wants_trainer), lambda seen: getattr(seen, done), timeout_s)


def poll_until(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> tuple[Any, float]:
    """Read every POLL_S until ``done`` holds of what was read; (the last read, seconds
    waited). Through an etcd outage it keeps asking until the timeout."""
    from rlfleet.common.control.store import StoreUnavailable

    started = time.monotonic()
    last = None
    while True:
        try:
            last = read()
            if done(last):
                return last, time.monotonic() - started
        except StoreUnavailable:
            pass
        if time.monotonic() - started >= timeout_s:
            return last, time.monotonic() - started
        time.sleep(POLL_S)


def write_state(store, keys, etcd: str, record) -> None:
    """Write the job's `state` record (pause, resume, stop, start); exit 3 when etcd cannot be reached."""
    from rlfleet.common.control.store import StoreUnavailable

    try:
        store.put(keys.state, record.to_value())
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)


timeout_option = click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=DEFAULT_TIMEOUT_S,
                              show_default=True, metavar="S", help="How long to wait for the fleet to confirm.")
no_wait_option = click.option("--no-wait", is_flag=True, help="Write the request and return at once.")
job_option = click.option("--job", callback=job_name, default=None, help="Job name; optional when etcd holds only one.")
reason_option = click.option("--reason", default="", metavar="TEXT", help="Why (shown by `rlfleet status`).")


def state_request_options(command: Callable) -> Callable:
    """The options of a command that writes the job's state and waits for it (pause, stop)."""
    for option in reversed((job_option, etcd_option, reason_option, timeout_option, no_wait_option)):
        command = option(command)
    return command


@click.command()
@state_request_options
def pause(job: str | None, etcd: str, reason: str, timeout_s: float, no_wait: bool) -> None:
    """Maintenance mode: agents start, restart and stop nothing; the trainer finishes its
    step, checkpoints and takes no new batch (what arrives waits in its journal).

    Waits until the trainer leader is paused with its version checkpointed and every
    node agent observes only. Exit 0 done (or already paused), 9 no spec for the job,
    10 not confirmed within --timeout (the pause stays in effect; `rlfleet resume`)."""
    from rlfleet.common.control.operations import PAUSED, JobState
    from rlfleet.common.control.pause import describe

    store, keys, spec, current = open_job(etcd, job)
    if current is not None and current.paused:
        click.echo(f"{describe(current).replace('job', f'job {keys.job} is already', 1)}; "
                   "`rlfleet resume` to continue")
        return
    record = JobState(PAUSED, round(time.time(), 3), operator_name(), reason)
    write_state(store, keys, etcd, record)
    click.echo(f"{describe(record).replace('job', f'job {keys.job}', 1)}")
    if no_wait:
        return
    seen, waited = _wait(store, keys, spec.all_roles().get("trainer", 0) > 0, "paused", timeout_s)
    if seen is not None and seen.paused:
        hosts = seen.hosts(True)
        click.echo(f"{seen.trainer_line()}; {len(hosts)} hosts observing only"
                   f"{' (' + ', '.join(hosts) + ')' if hosts else ''}; confirmed in {waited:.1f} s")
        click.echo("`rlfleet resume` to continue")
        return
    _not_confirmed("pause", timeout_s, seen,
                   lambda s: f"hosts not yet observing only: {', '.join(s.hosts(False)) or 'none'}",
                   " (`rlfleet resume` lifts it)")


@click.command()
@job_option
@etcd_option
@timeout_option
@no_wait_option
def resume(job: str | None, etcd: str, timeout_s: float, no_wait: bool) -> None:
    """End maintenance mode: agents act on placement again (restarting what died while
    paused), the trainer takes batches again from where it stopped.

    Waits until no trainer and no node agent reports paused. Exit 0 done (or not
    paused), 9 no spec for the job, 10 not confirmed within --timeout (the resume
    stays in effect)."""
    from rlfleet.common.control.operations import RUNNING, JobState

    store, keys, spec, current = open_job(etcd, job)
    if current is None or not current.paused:
        click.echo(f"job {keys.job} is not paused")
        return
    write_state(store, keys, etcd, JobState(RUNNING, round(time.time(), 3), operator_name(), ""))
    click.echo(f"job {keys.job} resumed by {operator_name()} (paused since "
               f"{time.strftime('%H:%M:%S', time.localtime(current.since))})")
    if no_wait:
        return
    seen, waited = _wait(store, keys, spec.all_roles().get("trainer", 0) > 0, "resumed", timeout_s)
    if seen is not None and seen.resumed:
        click.echo(f"{seen.trainer_line()}; no host paused; confirmed in {waited:.1f} s")
        return
    _not_confirmed("resume", timeout_s, seen, lambda s: f"hosts still paused: {', '.join(s.hosts(True)) or 'none'}")
