from __future__ import annotations

import pytest

from rlfleet.common.control.keys import JobKeys


def test_layout_matches_architecture():
    k = JobKeys("demo")
    assert k.spec == "/rlfleet/demo/spec"
    assert k.node("h1") == "/rlfleet/demo/nodes/h1"
    assert k.member("rollout", "rollout-0") == "/rlfleet/demo/members/rollout/rollout-0"
    assert k.leader("trainer") == "/rlfleet/demo/leader/trainer"
    assert k.placement("h1", "relay", "relay-0") == "/rlfleet/demo/placement/h1/relay/relay-0"
    assert k.weights_latest == "/rlfleet/demo/weights/latest"
    assert k.relay_chain == "/rlfleet/demo/relay/chain"
    assert k.prompts_cursor == "/rlfleet/demo/prompts/cursor"
    assert k.trainer_checkpoint == "/rlfleet/demo/trainer/checkpoint"


def test_parse_round_trips():
    k = JobKeys("demo")
    assert k.parse_member(k.member("env-host", "e-1")) == ("env-host", "e-1")
    assert k.parse_placement(k.placement("h", "rollout", "r-2")) == ("h", "rollout", "r-2")
    with pytest.raises(ValueError):
        k.parse_member("/rlfleet/other/members/x/y")


@pytest.mark.parametrize("bad", ["", "a/b", "../x", " x"])
def test_components_that_would_alias_other_keys_are_refused(bad):
    with pytest.raises(ValueError, match="etcd key component"):
        JobKeys("demo").member("rollout", bad)


@pytest.mark.parametrize("bad", ["Demo", "my_job", "a.b", "-x", "x" * 64])
def test_a_job_key_takes_only_a_job_name(bad):
    """JobKeys checked the looser key-component rule, so a name `job validate` refuses
    (upper case, '_', '.') could still address keys from a tool's --job."""
    with pytest.raises(ValueError, match="invalid job name"):
        JobKeys(bad)
