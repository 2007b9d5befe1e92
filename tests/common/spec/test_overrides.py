"""with_bind_host: the spec a daemon uses on a cluster host binds to that host's address."""

from __future__ import annotations

from rlfleet.common.spec.job import load_spec
from rlfleet.common.spec.overrides import with_bind_host
from tests.integration.helpers import write_spec

SECTIONS_THAT_BIND = ("trainer", "rollout", "relay", "env_host", "reward_host")


def test_every_bind_host_is_replaced_and_nothing_else(tmp_path):
    spec = load_spec(write_spec(tmp_path, extra="\n[relay]\nbind_host = \"127.0.0.9\"\nchunk_mib = 8\n"))
    moved = with_bind_host(spec, "10.200.0.3")
    for name in SECTIONS_THAT_BIND:
        assert getattr(moved, name).bind_host == "10.200.0.3"
    expected = spec.to_dict()
    for name in SECTIONS_THAT_BIND:
        expected[name]["bind_host"] = "10.200.0.3"
    assert moved.to_dict() == expected  # relay.chunk_mib and the rest untouched
    assert spec.relay.bind_host == "127.0.0.9"  # the original is not modified


def test_no_host_leaves_the_spec_as_it_is(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    assert with_bind_host(spec, None) is spec
    assert with_bind_host(spec, "") is spec


def test_the_fields_this_replaces_are_all_the_bind_hosts_of_the_spec(tmp_path):
    """A new section with a bind_host is picked up without a list to update."""
    spec = load_spec(write_spec(tmp_path))
    found = {name for name, section in spec if hasattr(section, "bind_host")}
    assert found == set(SECTIONS_THAT_BIND)
