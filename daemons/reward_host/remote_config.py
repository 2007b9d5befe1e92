"""The ``remote_http`` reward backend's spec table (``[reward_host.backend]``): rewards
scored by HTTP endpoints ("serverless" reward functions, RollArt §5.2).

A light module (pydantic only): the spec imports it to validate, ``build`` imports the
implementation (remote.py, with its HTTP client) only when a reward-host starts.
The wire protocol and the failure handling are described in remote.py and
docs/reward.md ("Remote endpoints")::

    [reward_host.backend]
    kind = "remote_http"
    endpoints = ["http://10.0.0.5:8000/score", "http://10.0.0.6:8000/score"]
    max_concurrency = 16            # requests in flight per endpoint
    timeout_s = 30                  # one attempt, connect to last byte
    total_timeout_s = 120           # one job, queueing and retries included
    auth_secret_file = "/etc/rlfleet/reward-token"   # optional; never the token itself

    [reward_host.backend.retry]
    max_attempts = 4
    backoff_base_s = 0.2
    backoff_max_s = 10
    jitter = "full"

    [reward_host.backend.breaker]
    failures = 5
    open_s = 10
    half_open_probes = 1
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from rlfleet.common.registry import Kind, KindConfig
from rlfleet.common.spec_fields import PosFloat, PosInt, Section, fail, num, show

# An HTTP header name (RFC 9110 token); the value comes from the secret file.
_TOKEN_CHARS = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def check_url(url: str) -> str:
    """An endpoint URL as the backend will POST to it: http(s), a host, a valid port,
    no credentials (they belong in auth_secret_file), no fragment, no whitespace."""
    if not url or url != url.strip() or any(c.isspace() for c in url):
        raise fail(f"must be an http:// or https:// URL without spaces, got {show(url)}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as exc:
        raise fail(f"not a valid URL ({exc}): {show(url)}") from None
    if parts.scheme not in ("http", "https"):
        raise fail(f"must start with http:// or https://, got {show(url)}")
    if not parts.hostname:
        raise fail(f"has no host: {show(url)}")
    if port == 0:
        raise fail(f"port must be 1..65535, got 0 in {show(url)}")
    if parts.username is not None or parts.password is not None:
        raise fail(f"must not carry credentials (put the header value in auth_secret_file): "
                   f"{parts.scheme}://...@{parts.hostname}")
    if parts.fragment:
        raise fail(f"must not have a #fragment (it is never sent), got {show(url)}")
    return url


def _endpoints(value: Any) -> Any:
    # One URL or a list of them; a list may not repeat one (its limit would double).
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list):
        raise fail(f"expected a URL or a list of URLs, got {show(value)}")
    if not urls:
        raise fail("must name at least one endpoint URL")
    out = []
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise fail(f"[{i}] expected a URL string, got {show(url)}")
        try:
            out.append(check_url(url))
        except PydanticCustomError as exc:
            raise fail(f"[{i}] {exc.message()}") from None
    seen = set()
    for url in out:
        if url in seen:
            raise fail(f"{url} is listed twice")
        seen.add(url)
    return tuple(out)


def _absolute(path: str | None) -> str | None:
    # Read by the reward-host on its own machine, from its own working directory.
    if path is not None and not os.path.isabs(path):
        raise fail(f"must be an absolute path (the reward-host reads it on its own machine), "
                   f"got {show(path)}")
    return path


def _header_name(name: str) -> str:
    if not name or not set(name) <= _TOKEN_CHARS:
        raise fail(f"must be an HTTP header name (letters, digits, '-'), got {show(name)}")
    return name


class RetryConfig(Section):
    max_attempts: PosInt = 4  # attempts per job, the first included; 1 = no retry
    backoff_base_s: PosFloat = 0.2  # the cap of the first backoff, doubled per attempt ...
    backoff_max_s: PosFloat = 10.0  # ... up to this
    jitter: Literal["full", "none"] = "full"  # full: uniform in [0, cap] (AWS "full jitter")

    @model_validator(mode="after")
    def _order(self) -> RetryConfig:
        if self.backoff_max_s < self.backoff_base_s:
            raise fail(f"backoff_max_s ({num(self.backoff_max_s)}) must be >= backoff_base_s "
                       f"({num(self.backoff_base_s)})")
        return self


class BreakerConfig(Section):
    failures: PosInt = 5  # consecutive failed attempts that open an endpoint's circuit
    open_s: PosFloat = 10.0  # how long it stays open before half-open probes
    half_open_probes: PosInt = 1  # requests let through while half-open


class RemoteHttpConfig(KindConfig):
    kind: Literal["remote_http"] = "remote_http"
    endpoints: Annotated[Any, AfterValidator(_endpoints)]  # one URL or a list; required
    max_concurrency: PosInt = 16  # requests in flight per endpoint
    timeout_s: PosFloat = 30.0  # one attempt, from connecting to the last byte of the answer
    connect_timeout_s: PosFloat = 5.0  # the TCP/TLS connect part of an attempt (at most timeout_s)
    total_timeout_s: PosFloat = 120.0  # one job: queueing, attempts and backoffs together
    auth_header: Annotated[StrictStr, AfterValidator(_header_name)] = "Authorization"
    # The header's value (e.g. "Bearer abc...") is the file's content, read at start;
    # never the token in the spec, which is stored in etcd and in run folders.
    auth_secret_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    retry: RetryConfig = Field(default_factory=RetryConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)

    @model_validator(mode="after")
    def _fits(self) -> RemoteHttpConfig:
        if self.total_timeout_s < self.timeout_s:
            raise fail(f"total_timeout_s ({num(self.total_timeout_s)}) must be >= timeout_s "
                       f"({num(self.timeout_s)}): no attempt could run to its own timeout")
        if self.breaker.half_open_probes > self.max_concurrency:
            raise fail(f"breaker.half_open_probes ({self.breaker.half_open_probes}) must be <= "
                       f"max_concurrency ({self.max_concurrency})")
        return self


def read_secret(path: str) -> str:
    """An auth header's value: the file's content without the trailing newline (the
    remote_http backend's header, the shared reward service's expected one); read at start."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as exc:
        raise ValueError(f"auth_secret_file: cannot read {path}: {exc.strerror}") from None
    if not value or any(c in value for c in "\r\n\0"):
        raise ValueError(f"auth_secret_file: {path} must hold one non-empty line (the header value)")
    return value


class RemoteHttp(Kind):
    Config = RemoteHttpConfig

    @classmethod
    def build(cls, config: RemoteHttpConfig, /, *, dispatch: Any = None, batch_requests: int = 0,
              **_: Any) -> Any:
        from .remote import RemoteBackend

        return RemoteBackend(config, dispatch=dispatch, batch_requests=batch_requests)
