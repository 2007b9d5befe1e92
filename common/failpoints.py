"""Test hooks in production code, all named and parsed here: a reader sees every way a
test can bend a daemon in one place, and no daemon reads its own environment variable.

Each is an environment variable, unset in production, where reading it is all it costs:

``RLFLEET_DAEMON_FAILPOINT`` (``rlfleet daemon``)
    ``exit_at_start:ROLE``: that role's process exits 1 at once (a crash loop without a
    broken spec); ``stall_if_file:ROLE:PATH``: the first main-loop cycle that finds PATH
    deletes it and blocks for good (a stalled loop whose threads still run).
``RLFLEET_TRAINER_FAILPOINT`` (the trainer's crash tests)
    ``exit_after_journal``: exit 17 between a trajectory's fsync and its ack;
    ``kill_<where>:<version>``: SIGKILL itself at ``where`` while making ``version``:
    ``mid_step`` (the update is in the weights, the journal has not recorded it),
    ``mid_checkpoint`` (the files are written, the folder not yet renamed), ``mid_publish``
    (the version is journaled and handed to the publisher thread).
``RLFLEET_TRAINER_STEP_DELAY_S`` (tests and tools/bench/losses.py)
    seconds the trainer waits after every step: a slowed trainer, so rollouts run ahead.
``RLFLEET_REPACK_FAILPOINT`` (the repack-manager)
    ``kill_mid_plan``: SIGKILL itself once per run, after a plan's orders went out and
    before it is recorded done.
``RLFLEET_RELAY_CORRUPT`` (a relay node)
    ``version:layout:chunk[,...]``: flip one byte of those outgoing chunks once (its own
    copy stays intact).
``RLFLEET_RELAY_PACE_S`` (a relay node)
    seconds each hop waits per chunk: slow hops, so versions overlap in the chain.
"""

from __future__ import annotations

import os
import signal

DAEMON = "RLFLEET_DAEMON_FAILPOINT"
TRAINER = "RLFLEET_TRAINER_FAILPOINT"
TRAINER_STEP_DELAY_S = "RLFLEET_TRAINER_STEP_DELAY_S"
REPACK = "RLFLEET_REPACK_FAILPOINT"
RELAY_CORRUPT = "RLFLEET_RELAY_CORRUPT"
RELAY_PACE_S = "RLFLEET_RELAY_PACE_S"
NAMES = (DAEMON, TRAINER, TRAINER_STEP_DELAY_S, REPACK, RELAY_CORRUPT, RELAY_PACE_S)


def _get(name: str) -> str:
    return os.environ.get(name, "")


def _seconds(name: str) -> float:
    raw = _get(name)
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


# -- rlfleet daemon -------------------------------------------------------------------
def daemon_exits_at_start(role: str) -> bool:
    return _get(DAEMON) == f"exit_at_start:{role}"


def daemon_stall_file(role: str) -> str | None:
    """The PATH of ``stall_if_file:ROLE:PATH`` for this role, else None."""
    before, _, path = _get(DAEMON).partition(f"stall_if_file:{role}:")
    return path if path and not before else None


# -- trainer --------------------------------------------------------------------------
def trainer_exits_after_journal() -> bool:
    return _get(TRAINER) == "exit_after_journal"


def trainer_kill_at(where: str, version: int) -> None:
    if _get(TRAINER) == f"kill_{where}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def trainer_step_delay_s() -> float:
    return _seconds(TRAINER_STEP_DELAY_S)


# -- repack-manager -------------------------------------------------------------------
def repack_kills_mid_plan() -> bool:
    return _get(REPACK) == "kill_mid_plan"


# -- relay ----------------------------------------------------------------------------
def relay_corrupt_chunks() -> set[tuple[int, int, int]]:
    out = set()
    for item in filter(None, _get(RELAY_CORRUPT).split(",")):
        try:
            version, layout, chunk = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"{RELAY_CORRUPT} items are version:layout:chunk, got {item!r}") from None
        out.add((version, layout, chunk))
    return out


def relay_pace_s() -> float:
    return _seconds(RELAY_PACE_S)
