"""The ``remote_http`` reward backend's spec table (``[reward_host.backend]``): rewards
scored by HTTP endpoints ("serverless" reward functions, RollArt §5.2).

A light module (pydantic only): the spec imports it to validate, ``build`` imports the
implementation (remote.py, with its HTTP client) only when a reward-host starts.
The wire protocol and the failure handling are described in remote.py and
docs/design/reward.md ("Remote endpoints")::

    [reward_host.backend]
    kind = "remote_http"
    endpoints = ["http://10.0.0.5:8000/score", "http://10.0.0.6:8000/score"]
    max_concurrency = 16            # requests in flight per endpoint
    timeout_s = 30                  # one attempt, connect to last byte
    total_timeout_s = 120           # one job, queueing and retries included
    auth_secret_file = "/etc/rlfleet/reward-token"   # optional; never the token itself
    ca_file = "/etc/rlfleet/ca.crt"   # optional: the CA that https:// endpoints are checked against
    client_cert_file = "/etc/rlfleet/client.crt"     # optional, with client_key_file: for a
    client_key_file = "/etc/rlfleet/client.key"      # service that asks for a client certificate

    [reward_host.backend.retry]
    max_attempts = 4
    backoff_base_s = 0.2
    backoff_max_s = 10
    jitter = "full"

    [reward_host.backend.breaker]
    failures = 5
    open_s = 10
    half_open_probes = 1

Transport: a token (``auth_secret_file``) is sent over ``https://`` or to a loopback
address only; over plain ``http://`` to any other host it would cross the network in
clear, and the spec is refused. ``ca_file`` is the CA an ``https://`` endpoint's
certificate must chain to (for the shared reward service, the job's CA that issued its
certificate; unset: the system's trust store). ``tls_context`` builds the TLS settings
of both sides, this backend's and the shared reward service's (shared_spec.py).
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from rlfleet.common.secret_files import SecretFileError, read_private
from rlfleet.common.spec.fields import PosFloat, PosInt, Section, fail, num, show
from rlfleet.common.spec.registry import Kind, KindConfig

if TYPE_CHECKING:
    import ssl

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
    # The CA that https:// endpoints' certificates must chain to (the job's CA); read at
    # start. Unset: the system's trust store.
    ca_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    # A client certificate and its key (mode 0600), for an endpoint that asks for one
    # (the shared reward service with [tls] client_ca_file); both or neither.
    client_cert_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    client_key_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
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
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise fail("client_cert_file and client_key_file go together: give both or neither")
        parts = [urllib.parse.urlsplit(url) for url in self.endpoints]
        if all(p.scheme == "http" for p in parts) and (self.ca_file or self.client_cert_file):
            given = "ca_file" if self.ca_file else "client_cert_file"
            raise fail(f"{given} is set but no endpoint is https:// (TLS is only spoken to https:// URLs)")
        if self.auth_secret_file:
            for i, (url, p) in enumerate(zip(self.endpoints, parts)):
                host = p.hostname or ""
                if p.scheme == "http" and not is_loopback(host):
                    raise fail(f"endpoints[{i}]: {url} is plain http:// to {host}, which is not a "
                               "loopback address: the auth_secret_file token would cross the network "
                               "in clear; use https:// (with ca_file, the CA that issued its certificate)")
        return self

    def client_tls(self) -> ssl.SSLContext | None:
        """The client's TLS settings when the spec has any (``ca_file``, a client
        certificate); None: the HTTP client's defaults. TlsFileError names a bad file."""
        if not (self.ca_file or self.client_cert_file):
            return None
        return tls_context(False, cert=self.client_cert_file, key=self.client_key_file, ca=self.ca_file,
                           names=("client_cert_file", "client_key_file", "ca_file"))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's hostname, or --listen's host) is this machine's loopback:
    ``localhost``, 127.0.0.0/8 or ::1. Other names are not resolved: they count as remote."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TlsFileError(ValueError):
    """A TLS file that cannot be used: ``key`` is its spec key, ``message`` names the file."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def tls_context(server: bool, *, cert: str | None = None, key: str | None = None, ca: str | None = None,
                names: tuple[str, str, str] = ("cert_file", "key_file", "ca_file")) -> ssl.SSLContext:
    """A TLS 1.2+ context. Server: ``cert``/``key`` its certificate (required), ``ca``
    optional: clients must then present a certificate it issued. Client: ``ca`` the CA
    servers' certificates must chain to (default: the system's), host names checked;
    ``cert``/``key`` an optional client certificate. A key must be mode 0600 (a secret,
    secret_files.py). ``names`` are the spec keys of cert, key and ca, for TlsFileError."""
    import ssl

    cert_name, key_name, ca_name = names
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        _pem(ca_name, "CA certificate", ca, b"-----BEGIN CERTIFICATE-----")
        try:
            ctx.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise TlsFileError(ca_name, f"CA certificate {ca}: unusable ({exc.reason or exc})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    elif not server:
        ctx.load_default_certs()
    if cert is not None and key is not None:
        _pem(cert_name, "certificate", cert, b"-----BEGIN CERTIFICATE-----")
        try:
            pem = read_private(key, "private key")
        except SecretFileError as exc:
            raise TlsFileError(key_name, str(exc)) from None
        if b"PRIVATE KEY-----" not in pem:
            raise TlsFileError(key_name, f"private key {key}: no PEM private key in it")
        if b"ENCRYPTED" in pem:
            raise TlsFileError(key_name, f"private key {key}: encrypted; give it unencrypted (mode 0600)")
        try:
            ctx.load_cert_chain(cert, key, password=lambda: b"")  # never a prompt on the terminal
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise TlsFileError(key_name, f"private key {key}: not the key of {cert_name} {cert}") from None
            raise TlsFileError(cert_name, f"certificate {cert}: unusable with {key_name} {key} "
                                          f"({exc.reason or exc})") from None
    return ctx


def _pem(name: str, what: str, path: str, marker: bytes) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsFileError(name, f"{what} {path}: cannot read: {exc.strerror or exc}") from None
    if marker not in data:
        raise TlsFileError(name, f"{what} {path}: no PEM certificate in it")


def read_secret(path: str) -> str:
    """An auth header's value: the file's content without the trailing newline (the
    remote_http backend's header, the shared reward service's expected one); read at start.
    Like every secret, only from a file its owner alone can read (common/secret_files.py)."""
    try:
        value = read_private(path, "auth_secret_file").decode("utf-8").strip()
    except SecretFileError as exc:
        raise ValueError(str(exc)) from None
    except UnicodeDecodeError:
        raise ValueError(f"auth_secret_file: {path} is not UTF-8 text") from None
    if not value or any(c in value for c in "\r\n\0"):
        raise ValueError(f"auth_secret_file: {path} must hold one non-empty line (the header value)")
    return value


class RemoteHttp(Kind):
    Config = RemoteHttpConfig

    @classmethod
    def build(cls, config: RemoteHttpConfig, /, *, dispatch: Any = None, batch_requests: int = 0,
              **_: Any) -> Any:
        from rlfleet.daemons.reward_host.remote.backend import RemoteBackend

        return RemoteBackend(config, dispatch=dispatch, batch_requests=batch_requests)
