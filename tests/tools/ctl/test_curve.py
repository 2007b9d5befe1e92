"""`rlfleet curve-keys` and `rlfleet curve-authorize` (tools/ctl/curve.py): the one
command per host Ansible runs to make a host's role pairs and to authorize the cluster's
keys. Real files; the CLI through click's runner."""

from __future__ import annotations

import json
import stat

from click.testing import CliRunner

from rlfleet.common.wire import curve
from rlfleet.tools.cli import main


def run(*args: str, stdin: str | None = None):
    return CliRunner().invoke(main, list(args), input=stdin, catch_exceptions=False)


def test_curve_keys_makes_what_is_missing_and_shows_without_making(tmp_path):
    d = tmp_path / "curve"
    first = json.loads(run("curve-keys", str(d), "--name", "h1", "--json", "--role", "trainer",
                           "--role", "env-host").output)
    assert first["created"] == ["trainer", "env-host"] and set(first["public"]) == {"trainer", "env-host"}
    assert stat.S_IMODE((d / "trainer.key_secret").stat().st_mode) == 0o600
    again = json.loads(run("curve-keys", str(d), "--name", "h1", "--json", "--role", "trainer",
                           "--role", "reward-host").output)
    assert again["created"] == ["reward-host"] and again["public"]["trainer"] == first["public"]["trainer"]
    shown = json.loads(run("curve-keys", str(d), "--show", "--json").output)
    assert shown == {"created": [], "public": again["public"]}
    assert json.loads(run("curve-keys", str(tmp_path / "none"), "--show", "--json").output)["public"] == {}
    setup = curve.CurveSetup.load(d, "env-host")
    assert setup.roles[setup.public] == "env-host"


def test_curve_authorize_writes_only_what_differs_and_refuses_bad_input(tmp_path):
    d = tmp_path / "curve"
    keys = {h: json.loads(run("curve-keys", str(tmp_path / h), "--name", h, "--json", "--role", "rollout",
                              "--role", "env-host").output)["public"] for h in ("h1", "h2")}
    out = json.loads(run("curve-authorize", str(d), stdin=json.dumps(keys)).output)
    assert sorted(out["changed"]) == sorted(str(d / "authorized" / r / f"{h}.key")
                                            for h in keys for r in ("rollout", "env-host"))
    assert json.loads(run("curve-authorize", str(d), stdin=json.dumps(keys)).output) == {"changed": []}
    roles = curve.load_authorized(d / "authorized")
    assert {roles[k.encode()] for h in keys for k in keys[h].values()} == {"rollout", "env-host"}
    for bad, why in (("[]", "expected an object"), ('{"h1": {"admin": "x"}}', "'admin' is not a role"),
                     ('{"h1": {"trainer": "short"}}', "not a 40-character Z85 public key"),
                     ('{"../x": {}}', "expected a host name"), ("not json", "curve-authorize")):
        result = CliRunner().invoke(main, ["curve-authorize", str(d)], input=bad)
        assert result.exit_code == 1 and why in result.output, (bad, result.output)
