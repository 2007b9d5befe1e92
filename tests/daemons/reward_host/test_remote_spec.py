"""The remote_http backend's spec table through load_spec: every key it refuses, with
its path and the numbers that were wrong, as `rlfleet job validate` prints them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.spec.job import load_spec
from tests.integration.helpers import spec_errors

REPO = Path(__file__).resolve().parents[3]
HEAD = f"""\
[job]
name = "t"
[model]
path = "{REPO / 'models' / 'tiny-qwen2'}"
[task.env]
kind = "arithmetic"
[reward_host.backend]
kind = "remote_http"
"""
URL = 'endpoints = "http://127.0.0.1:8700/score"\n'


def errors(tmp_path: Path, text: str) -> list[str]:
    return spec_errors(tmp_path / "job.toml", HEAD + text)


def test_one_url_or_a_list_and_the_defaults(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(HEAD + 'endpoints = ["http://a:8000/score", "https://b.example/v1/score"]\n')
    backend = load_spec(path).reward_host.backend
    assert backend.endpoints == ("http://a:8000/score", "https://b.example/v1/score")
    assert (backend.max_concurrency, backend.timeout_s, backend.total_timeout_s) == (16, 30.0, 120.0)
    assert backend.retry.model_dump() == {"max_attempts": 4, "backoff_base_s": 0.2,
                                          "backoff_max_s": 10.0, "jitter": "full"}
    assert backend.breaker.model_dump() == {"failures": 5, "open_s": 10.0, "half_open_probes": 1}
    assert backend.auth_secret_file is None
    path.write_text(HEAD + URL)
    assert load_spec(path).reward_host.backend.endpoints == ("http://127.0.0.1:8700/score",)


def test_the_shipped_example_loads():
    backend = load_spec(REPO / "examples" / "arithmetic-remote.toml").reward_host.backend
    assert backend.kind == "remote_http" and backend.endpoints == ("http://127.0.0.1:8700/score",)


P = "reward_host.backend"


@pytest.mark.parametrize(("text", "expected"), [
    ("", f"{P}.endpoints: required key missing"),
    ("endpoints = []", f"{P}.endpoints: must name at least one endpoint URL"),
    ("endpoints = 3", f"{P}.endpoints: expected a URL or a list of URLs, got 3"),
    ('endpoints = "ftp://h/score"', f"{P}.endpoints: [0] must start with http:// or https://, got 'ftp://h/score'"),
    ('endpoints = ["http://h/s", 3]', f"{P}.endpoints: [1] expected a URL string, got 3"),
    ('endpoints = "http:///score"', f"{P}.endpoints: [0] has no host: 'http:///score'"),
    ('endpoints = "http://h:99999/s"', f"{P}.endpoints: [0] not a valid URL (Port out of range 0-65535): 'http://h:99999/s'"),
    ('endpoints = "http://h:0/s"', f"{P}.endpoints: [0] port must be 1..65535, got 0 in 'http://h:0/s'"),
    ('endpoints = "http://h/s #x"', f"{P}.endpoints: [0] must be an http:// or https:// URL without spaces, got 'http://h/s #x'"),
    ('endpoints = "http://h/s#x"', f"{P}.endpoints: [0] must not have a #fragment (it is never sent), got 'http://h/s#x'"),
    # The password is not echoed back: validation errors end up in logs.
    ('endpoints = "https://u:pw@h/s"', f"{P}.endpoints: [0] must not carry credentials (put the header value in auth_secret_file): https://...@h"),
    ('endpoints = ["http://h/s", "http://h/s"]', f"{P}.endpoints: http://h/s is listed twice"),
    (URL + "max_concurrency = 0", f"{P}.max_concurrency: must be > 0, got 0"),
    (URL + "timeout_s = -1", f"{P}.timeout_s: must be > 0, got -1"),
    (URL + "timeout_s = 60\ntotal_timeout_s = 30", f"{P}: total_timeout_s (30) must be >= timeout_s (60): no attempt could run to its own timeout"),
    (URL + 'auth_secret_file = "token"', f"{P}.auth_secret_file: must be an absolute path (the reward-host reads it on its own machine), got 'token'"),
    (URL + 'auth_header = "X Token"', f"{P}.auth_header: must be an HTTP header name (letters, digits, '-'), got 'X Token'"),
    (URL + 'auth_token = "abc"', f"{P}.auth_token: unknown key"),
    (URL + "workers = 2", f"{P}.workers: unknown key"),  # a rule_pool key
    (URL + "[reward_host.backend.retry]\nmax_attempts = 0", f"{P}.retry.max_attempts: must be > 0, got 0"),
    (URL + "[reward_host.backend.retry]\nbackoff_base_s = 5\nbackoff_max_s = 1", f"{P}.retry: backoff_max_s (1) must be >= backoff_base_s (5)"),
    (URL + '[reward_host.backend.retry]\njitter = "half"', f"{P}.retry.jitter: must be one of 'full', 'none', got 'half'"),
    (URL + "[reward_host.backend.breaker]\nopn_s = 3", f"{P}.breaker.opn_s: unknown key (did you mean 'open_s'?)"),
    (URL + "[reward_host.backend.breaker]\nfailures = 0", f"{P}.breaker.failures: must be > 0, got 0"),
    (URL + "max_concurrency = 2\n[reward_host.backend.breaker]\nhalf_open_probes = 3", f"{P}: breaker.half_open_probes (3) must be <= max_concurrency (2)"),
    # The token goes over https://, or over http:// to this machine only (issue 28).
    ('endpoints = ["https://a/s", "http://10.0.0.5:8000/score"]\nauth_secret_file = "/t"',
     f"{P}: endpoints[1]: http://10.0.0.5:8000/score is plain http:// to 10.0.0.5, which is not a loopback "
     "address: the auth_secret_file token would cross the network in clear; use https:// (with ca_file, "
     "the CA that issued its certificate)"),
    ('endpoints = "HTTP://reward.example/s"\nauth_secret_file = "/t"', f"{P}: endpoints[0]: HTTP://reward.example/s is plain http:// to reward.example, which is not a loopback "
     "address: the auth_secret_file token would cross the network in clear; use https:// (with ca_file, "
     "the CA that issued its certificate)"),
    (URL + 'ca_file = "/etc/ca.crt"', f"{P}: ca_file is set but no endpoint is https:// (TLS is only spoken to https:// URLs)"),
    ('endpoints = "https://a/s"\nclient_cert_file = "/c.crt"', f"{P}: client_cert_file and client_key_file go together: give both or neither"),
    ('endpoints = "https://a/s"\nca_file = "ca.crt"', f"{P}.ca_file: must be an absolute path (the reward-host reads it on its own machine), got 'ca.crt'"),
])
def test_refused_with_its_path(tmp_path, text, expected):
    assert errors(tmp_path, text + "\n") == [expected]


def test_a_token_over_https_or_to_loopback_is_accepted(tmp_path):
    path = tmp_path / "job.toml"
    for text in ('endpoints = ["https://10.0.0.5:8800/score"]\nca_file = "/etc/rlfleet/ca.crt"\n'
                 'client_cert_file = "/c.crt"\nclient_key_file = "/c.key"\n',
                 'endpoints = ["http://127.0.0.2:8800/s", "http://localhost/s", "http://[::1]:80/s"]\n'):
        path.write_text(HEAD + text + 'auth_secret_file = "/etc/rlfleet/reward-token"\n')
        assert load_spec(path).reward_host.backend.auth_secret_file == "/etc/rlfleet/reward-token"


def test_validating_imports_no_http_client():
    """`rlfleet job validate` stays instant: remote_config.py holds the config only."""
    import subprocess
    import sys

    code = ("import sys\nfrom rlfleet.common.spec.job import load_spec\n"
            f"load_spec({str(REPO / 'examples' / 'arithmetic-remote.toml')!r})\n"
            "print(sorted(m for m in ('httpx2', 'asyncio', 'zmq') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
