"""The node agent's decisions (daemons/agent/policy.py), on plain values and a given clock."""

from __future__ import annotations

import pytest

from rlfleet.common.control.placement import Placed
from rlfleet.daemons.agent import policy
from rlfleet.daemons.agent.policy import CrashLoop, Tracked

RM = Placed("h1", "resource-manager", "resource-manager-0")
ROLLOUT = Placed("h1", "rollout", "rollout-0")
RELAY = Placed("h1", "relay", "relay-0")


def test_plan_starts_what_is_placed_and_stops_what_is_not():
    tracked = {"relay-0": Tracked(RELAY, active=True), "resource-manager-0": Tracked(RM, active=True)}
    decided = policy.plan([RM, ROLLOUT], tracked, now=0.0)
    assert decided.start == (ROLLOUT,)  # the running resource-manager is left alone
    assert decided.stop == (RELAY,)


def test_plan_waits_for_the_backoff_and_never_starts_what_is_draining():
    t = Tracked(ROLLOUT, next_start_at=10.0)
    assert policy.plan([ROLLOUT], {"rollout-0": t}, now=9.9).start == ()
    assert policy.plan([ROLLOUT], {"rollout-0": t}, now=10.0).start == (ROLLOUT,)
    t.stopping = True
    assert policy.plan([ROLLOUT], {"rollout-0": t}, now=99.0) == policy.ReconcilePlan()


def test_an_id_placed_under_another_host_is_stopped_then_started_anew():
    moved = Placed("h2", "rollout", "rollout-0")
    running = {"rollout-0": Tracked(ROLLOUT, active=True)}
    decided = policy.plan([moved], running, now=0.0)
    assert decided.stop == (ROLLOUT,) and decided.start == ()
    gone = {"rollout-0": Tracked(ROLLOUT, active=False, next_start_at=50.0)}
    assert policy.plan([moved], gone, now=0.0).start == (moved,)  # its old backoff does not apply


def test_deaths_double_the_backoff_up_to_the_cap_and_a_healthy_run_resets_it():
    t = Tracked(ROLLOUT, active=True, started_at=0.0)
    waits = [policy.died(t, "exit code 1", now=float(i), crash_loop=CrashLoop()) for i in range(7)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert t.restarts == 7 and t.last_exit == "exit code 1" and not t.active
    assert t.next_start_at == 6.0 + 10.0
    policy.started(t, now=100.0)
    policy.still_running(t, now=100.0 + policy.HEALTHY_AFTER_S / 2)
    assert t.backoff_s == policy.BACKOFF_MAX_S  # not yet
    policy.still_running(t, now=100.0 + policy.HEALTHY_AFTER_S + 1)
    assert t.backoff_s == policy.BACKOFF_START_S


def test_failing_means_n_deaths_within_the_window():
    loop = CrashLoop(deaths=3, window_s=60.0)
    t = Tracked(ROLLOUT)
    for now in (0.0, 10.0):
        policy.died(t, "signal 9", now, loop)
    assert policy.crash_loop_span(t, loop, now=10.0) is None
    policy.died(t, "signal 9", 20.0, loop)
    assert policy.crash_loop_span(t, loop, now=20.0) == 20.0
    assert policy.daemon_report(t, loop, now=20.0) == {"role": "rollout", "state": "waiting", "restarts": 3,
                                                       "last_exit": "signal 9", "failing": True}
    # The window passes without a new death: no longer failing.
    assert policy.crash_loop_span(t, loop, now=61.0) is None
    assert policy.daemon_report(t, loop, now=61.0)["failing"] is False
    # More deaths than N are kept only as far as needed (and N larger than 5 works too).
    big = CrashLoop(deaths=8, window_s=60.0)
    t = Tracked(ROLLOUT)
    for i in range(8):
        policy.died(t, "exit code 1", float(i), big)
    assert policy.crash_loop_span(t, big, now=7.0) == 7.0 and len(t.deaths) == 8


def test_exit_descriptions():
    assert policy.exit_description(1) == "exit code 1"
    assert policy.exit_description(-9) == "signal 9"


def test_bootstrap_takes_the_resource_managers_of_the_agents_hosts_only():
    placed = [RM, ROLLOUT, Placed("h2", "resource-manager", "resource-manager-1")]
    assert policy.bootstrap(placed, ["h1"]) == [RM]
    assert policy.placeable("rollout") and not policy.placeable("agent") and not policy.placeable("rollot")


def test_labels_from_the_environment_syntax():
    assert policy.parse_labels("roles=trainer,rollout;cpu=x86") == {"roles": "trainer,rollout", "cpu": "x86"}
    assert policy.parse_labels(" gpu = h100 ;; ") == {"gpu": "h100"}
    assert policy.parse_labels("") == {}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        policy.parse_labels("roles")


def test_node_value_keeps_the_inventory_and_adds_what_the_agent_knows():
    value = policy.node_value({"host": "h1", "cpus_logical": 2}, {"cpu": "x86"}, {"pid": 7, "backend": "systemd"},
                              {"rollout-0": {"failing": False}})
    assert value == {"host": "h1", "cpus_logical": 2, "labels": {"cpu": "x86"},
                     "agent": {"pid": 7, "backend": "systemd"}, "daemons": {"rollout-0": {"failing": False}}}


def test_paused_plans_nothing_and_reports_what_is_down_as_held():
    # Paused (docs/operations/maintenance-mode.md): what is placed and down is not started (its backoff
    # long over), what runs and is no longer placed is not stopped.
    down = Tracked(ROLLOUT, next_start_at=0.0, restarts=1, last_exit="signal 9")
    unplaced = Tracked(RELAY, active=True)
    tracked = {"rollout-0": down, "relay-0": unplaced}
    assert policy.plan([ROLLOUT], tracked, now=99.0, paused=True) == policy.ReconcilePlan()
    assert policy.daemon_report(down, CrashLoop(), now=99.0, paused=True)["state"] == "held"
    assert policy.daemon_report(unplaced, CrashLoop(), now=99.0, paused=True)["state"] == "running"
    # Resumed: both acted on at once.
    assert policy.plan([ROLLOUT], tracked, now=99.0) == policy.ReconcilePlan(start=(ROLLOUT,), stop=(RELAY,))
    assert policy.daemon_report(down, CrashLoop(), now=99.0)["state"] == "waiting"


def test_node_value_says_paused_only_while_paused():
    assert "paused" not in policy.node_value({}, {}, {}, {})
    assert policy.node_value({}, {}, {}, {}, paused=True)["paused"] is True
