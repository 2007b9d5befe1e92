"""The relay's trust settings: the job secret file and `[relay] max_object_mib`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.job_secret import ENV_VAR, JobSecretError, job_secret_from_env, load_job_secret
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import parse_spec
from rlfleet.common.weights_size import model_float32_bytes
from rlfleet.relay.admission import CEILING_SLACK_BYTES, ceiling_bytes

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "tiny-qwen2"


def _secret_file(tmp_path: Path, mode: int, data: bytes = b"0123456789abcdef0123456789abcdef\n") -> Path:
    path = tmp_path / "job.secret"
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_an_owner_only_secret_file_is_read(tmp_path, mode):
    assert load_job_secret(_secret_file(tmp_path, mode)) == b"0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o610])
def test_a_secret_file_others_can_access_is_refused_naming_path_and_mode(tmp_path, mode):
    path = _secret_file(tmp_path, mode)
    with pytest.raises(JobSecretError) as exc:
        load_job_secret(path)
    assert str(path) in str(exc.value) and f"mode {mode:04o}" in str(exc.value) and "0600" in str(exc.value)


def test_a_missing_short_or_odd_secret_file_is_named(tmp_path):
    with pytest.raises(JobSecretError, match="cannot open"):
        load_job_secret(tmp_path / "nope")
    with pytest.raises(JobSecretError, match="at least 16 are needed"):
        load_job_secret(_secret_file(tmp_path, 0o600, b"short"))
    (tmp_path / "link").symlink_to(_secret_file(tmp_path, 0o600))
    with pytest.raises(JobSecretError, match="cannot open"):  # O_NOFOLLOW: the file itself, not a link
        load_job_secret(tmp_path / "link")


def test_the_secret_comes_from_the_environment_or_auth_is_off(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert job_secret_from_env() is None
    monkeypatch.setenv(ENV_VAR, "")
    assert job_secret_from_env() is None
    monkeypatch.setenv(ENV_VAR, str(_secret_file(tmp_path, 0o600)))
    assert job_secret_from_env() == b"0123456789abcdef0123456789abcdef"
    (tmp_path / "job.secret").chmod(0o644)
    with pytest.raises(JobSecretError, match="0644"):
        job_secret_from_env()


# ----------------------------------------------------------------- the ceiling
def _spec(relay: dict | None = None, trainer: dict | None = None):
    return parse_spec({"job": {"name": "t"}, "model": {"path": str(TINY)}, "task": {"env": {"kind": "arithmetic"}},
                       "relay": relay or {}, "trainer": trainer or {}})


def test_the_ceiling_defaults_to_twice_the_published_weights():
    f32 = model_float32_bytes(TINY)
    assert f32 is not None and f32 > 1_000_000  # float32 of the parameters, from the safetensors headers
    assert _spec().relay.max_object_mib is None
    assert ceiling_bytes(_spec()) == 2 * f32 + CEILING_SLACK_BYTES
    sim = _spec(trainer={"backend": {"kind": "sim", "weight_mib": 256}})
    assert ceiling_bytes(sim) == 2 * (256 << 20) + CEILING_SLACK_BYTES  # the sim backend's weights
    assert ceiling_bytes(_spec({"max_object_mib": 100})) == 100 << 20


@pytest.mark.parametrize("relay,message", [
    ({"max_object_mib": 0}, "relay.max_object_mib: must be > 0, got 0"),
    ({"max_object_mib": "1G"}, "relay.max_object_mib: expected an integer, got '1G'"),
])
def test_a_bad_ceiling_is_a_spec_error(relay, message):
    with pytest.raises(SpecError) as exc:
        _spec(relay)
    assert exc.value.errors == [f"<spec>: {message}"]


def test_a_ceiling_below_the_weights_would_refuse_every_version():
    with pytest.raises(SpecError) as exc:
        _spec({"max_object_mib": 100}, {"backend": {"kind": "sim", "weight_mib": 256}})
    assert exc.value.errors == ["<spec>: relay.max_object_mib: must be >= 256 (MiB of weights published per "
                                "version; the relays would refuse every version), got 100"]
