"""The shared reward service's own spec (``rlfleet reward-service --spec SERVICE.toml``;
the service: shared_service.py, docs/design/reward.md "Shared reward service")::

    [service]
    auth_secret_file = "/etc/rlfleet/reward-token"  # optional: the Authorization value asked for
    max_body_bytes = 1048576      # a larger request is refused (413) unread
    max_pending = 4096            # trajectories accepted and not answered yet; more: 503
    max_pending_per_tenant = 2048 # optional: the most of those one job may hold
    answer_within_s = 120         # a request still waiting then gets 503 (retry: same answer)
    results_kept = 200000         # answers remembered per (tenant, trajectory id)
    answers_journal = "/var/lib/rlfleet/reward-service/answers.jsonl"  # optional: kept on disk too

    [tls]                         # HTTPS; without it, plain HTTP on a loopback --listen only
    cert_file = "/etc/rlfleet/reward-service.crt"  # issued by the job's CA for the callers' host name
    key_file = "/etc/rlfleet/reward-service.key"   # its key, mode 0600
    client_ca_file = "/etc/rlfleet/ca.crt"         # optional: callers must present a certificate from it

    [pipeline]                    # the [reward_host.backend] table of kind "pipeline"
    queue = "ebf"
    scaling = "timeout_aware"
    [[pipeline.stages]]
    name = "check"
    worker = { kind = "rule_pool" }

The ``[pipeline]`` table is validated by the pipeline backend's own model
(pipeline.PipelineConfig; ``kind`` may be left out), so a stage is checked exactly as in
a job spec. Errors read as ``rlfleet job validate``'s: one line each, with the file, the
dotted key and the value. Light (pydantic only): validating starts nothing.

Transport: with ``[tls]`` the service serves HTTPS only (TLS 1.2 or newer), and
validating loads the files as the service will, so a missing, unreadable, non-PEM or
mismatched file (or a key others may read) is an error naming the key and the file.
Without ``[tls]`` it serves plain HTTP, and only on a loopback ``--listen`` address
(``listen_refusal``): a token and the trajectories crossing the network in clear is
refused rather than warned about, and loopback is still logged as a warning. There is no
``insecure`` switch: a TLS-terminating proxy in front listens for the network and talks to
the service on loopback.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, StrictStr, ValidationError

from rlfleet.common.spec.errors import SpecError, describe, dotted, suggest
from rlfleet.common.spec.fields import PosFloat, PosInt, Section, fail, show
from rlfleet.common.spec.file import read_spec_toml
from rlfleet.daemons.reward_host.pipeline.spec import PipelineConfig
from rlfleet.daemons.reward_host.remote.config import TlsFileError, is_loopback, tls_context

if TYPE_CHECKING:
    import ssl


def _absolute(path: str | None) -> str | None:
    if path is not None and not os.path.isabs(path):
        raise fail(f"must be an absolute path, got {show(path)}")
    return path


class ServiceSection(Section):
    # The Authorization header a request must carry is this file's content (as the
    # reference endpoint's --auth-file); never the token in the spec itself.
    auth_secret_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    max_body_bytes: PosInt = 1 << 20
    # Each waiting request holds a thread and a socket; beyond this many the service
    # answers 503 (retried by the caller with backoff) instead of queueing without bound.
    max_pending: PosInt = 4096
    # So that one job's burst cannot take every slot and turn the others away: its own
    # trajectories beyond this get 503 (retried) while the others' are still taken.
    max_pending_per_tenant: PosInt | None = None
    # A request waits this long for its trajectory's answer, then gets 503; the trajectory
    # stays in the pipeline, and the retry (same key) gets its answer when it comes.
    answer_within_s: PosFloat = 120.0
    results_kept: PosInt = 200_000
    # Answers also on disk (answer_journal.py), so a restart after kill -9 does not score
    # again what was answered; unset, the record is in memory only.
    answers_journal: Annotated[StrictStr | None, AfterValidator(_absolute)] = None


class TlsSection(Section):
    # The service's certificate (its chain, the leaf first) and key: issued by the job's
    # CA for the host name or address in the callers' endpoint URLs (docs/operations/security.md).
    cert_file: Annotated[StrictStr, AfterValidator(_absolute)]
    key_file: Annotated[StrictStr, AfterValidator(_absolute)]
    # Set: a caller must also present a client certificate issued by this CA.
    client_ca_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None

    def context(self) -> ssl.SSLContext:
        """The server's TLS settings, the files read now; TlsFileError names a bad one."""
        return tls_context(True, cert=self.cert_file, key=self.key_file, ca=self.client_ca_file,
                           names=("tls.cert_file", "tls.key_file", "tls.client_ca_file"))


class ServiceSpec(BaseModel):
    service: ServiceSection
    pipeline: PipelineConfig
    tls: TlsSection | None = None


def listen_refusal(spec: ServiceSpec, host: str) -> str:
    """Why ``spec`` may not be served on ``host`` (--listen's), or "": plain HTTP (no
    ``[tls]``) is for a loopback address only."""
    if spec.tls is not None or is_loopback(host):
        return ""
    return (f"--listen {host}: not a loopback address, and the spec has no [tls]: plain HTTP would "
            "carry the token and the trajectories in clear; give [tls] cert_file and key_file "
            "(a certificate from the job's CA), or listen on 127.0.0.1 behind a TLS proxy")


def parse_service_spec(data: Any, source: str = "<service spec>") -> ServiceSpec:
    """Validate a parsed service spec; SpecError with every problem, one line each."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a table at top level, got {show(data)}"])
    errors: list[tuple[tuple, str]] = [((key,), "unknown section" + suggest(key, ServiceSpec.model_fields))
                                       for key in data if key not in ServiceSpec.model_fields]
    valid: dict[str, BaseModel] = {}
    for name, model in (("service", ServiceSection), ("tls", TlsSection), ("pipeline", PipelineConfig)):
        raw = data.get(name, {} if name == "service" else None)
        if raw is None and name == "tls":
            continue  # optional: plain HTTP, on loopback only (listen_refusal)
        if raw is None:
            errors.append(((name,), "required table missing: the pipeline's stages"))
            continue
        if not isinstance(raw, dict):
            errors.append(((name,), f"expected a table, got {show(raw)}"))
            continue
        try:
            valid[name] = model.model_validate(raw)
        except ValidationError as exc:
            for err in exc.errors():
                loc, msg = describe(err, model)
                errors.append(((name, *loc), msg))
    tls = valid.get("tls")
    if isinstance(tls, TlsSection):
        try:  # the files as the service will load them: a bad one is a spec error, not a crash later
            tls.context()
        except TlsFileError as exc:
            errors.append(((exc.key,), exc.message))
    if errors:
        raise SpecError([f"{source}: {dotted(loc)}: {msg}" for loc, msg in errors])
    return ServiceSpec.model_validate(valid)


def load_service_spec(path: str | os.PathLike[str]) -> ServiceSpec:
    """As a job spec is read: a regular file of at most MAX_SPEC_BYTES of UTF-8 TOML."""
    return parse_service_spec(read_spec_toml(path), os.fspath(path))
