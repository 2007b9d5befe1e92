"""`rlfleet stop` and `rlfleet start`: a deployed job's durable stop (docs/operations/maintenance-mode.md).

`stop` writes `state` = stopped (who, when, why) and waits until no daemon of the job
is registered: every node agent stops what it runs and starts nothing while the job
is stopped, also after the agent restarts or its host reboots (the agents stay
enabled, the placement stays in etcd). `start` writes `state` = running: the agents
start the placed daemons again. The spec, the placement and every run file stay.

For a job its node agents run (`ansible/stop.yml`, `job.yml`); `rlfleet run` stops
its own job on SIGTERM.

Exit codes (tools/exit_codes.py OPERATOR_CODES): 0 done (or already so), 3 etcd
unreachable, 9 refused (no spec for the job), 10 not confirmed within --timeout (the
stop stays in effect).
"""

from __future__ import annotations

import sys
import time

import click

from rlfleet.tools.ctl.etcd_options import etcd_option
from rlfleet.tools.ctl.pause import (
    job_option,
    open_job,
    operator_name,
    poll_until,
    state_request_options,
    write_state,
)
from rlfleet.tools.exit_codes import Exit


def registered(store, keys) -> list[str]:
    """"role/id" of every member of the job but the node agents (which stay, starting nothing)."""
    from rlfleet.common.control.members import members_from

    return sorted(f"{m.role}/{m.id}" for m in members_from(keys, store.get_prefix(keys.members_prefix))
                  if m.role != "agent")


@click.command()
@state_request_options
def stop(job: str | None, etcd: str, reason: str, timeout_s: float, no_wait: bool) -> None:
    """Stop a deployed job for good: every node agent stops what it runs (SIGTERM: each
    daemon drains) and starts nothing, across its restarts and its host's reboots, until
    `rlfleet start`.

    Waits until no daemon of the job is registered. Exit 0 done (or already stopped),
    9 no spec for the job, 10 not confirmed within --timeout (the stop stays in effect)."""
    from rlfleet.common.control.operations import STOPPED, JobState
    from rlfleet.common.control.pause import describe

    store, keys, _, current = open_job(etcd, job)
    if current is not None and current.stopped:
        click.echo(f"{describe(current).replace('job', f'job {keys.job} is already', 1)}; "
                   "`rlfleet start` to run it again")
    else:
        record = JobState(STOPPED, round(time.time(), 3), operator_name(), reason)
        write_state(store, keys, etcd, record)
        click.echo(describe(record).replace("job", f"job {keys.job}", 1))
    if no_wait:
        return
    left, waited = poll_until(lambda: registered(store, keys), lambda names: not names, timeout_s)
    if left == []:
        click.echo(f"no daemon of job {keys.job} registered; confirmed in {waited:.1f} s; "
                   "`rlfleet start` to run it again")
        return
    still = ", ".join(left) if left else "nothing readable"
    click.echo(f"rlfleet stop: not confirmed within {timeout_s:g} s (still registered: {still}); the stop stays "
               "in effect", err=True)
    sys.exit(Exit.TIMED_OUT)


@click.command()
@job_option
@etcd_option
def start(job: str | None, etcd: str) -> None:
    """Run a stopped job again: its node agents start the placed daemons (`rlfleet status`
    follows them), which resume from their checkpoints and journals.

    Exit 0 done (or not stopped), 9 no spec for the job; a paused job stays paused
    (`rlfleet resume`)."""
    from rlfleet.common.control.operations import RUNNING, JobState

    store, keys, _, current = open_job(etcd, job)
    if current is None or not current.stopped:
        state = current.state if current is not None else "running"
        click.echo(f"job {keys.job} is not stopped ({state})" + ("; `rlfleet resume` ends a pause"
                                                                   if state == "paused" else ""))
        return
    write_state(store, keys, etcd, JobState(RUNNING, round(time.time(), 3), operator_name(), ""))
    click.echo(f"job {keys.job} started by {operator_name()} (stopped since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(current.since))}); its agents start "
               "the placed daemons")
