"""Per-machine overrides of a job spec, applied by the daemon that reads it.

The spec in etcd is one document for every machine of a job, but some settings
are the machine's own: the address a daemon binds its data-plane sockets to must
be this host's address on the cluster network, so that the address it publishes
in etcd is reachable from the other hosts (127.0.0.1, the spec's default, is not).
On a cluster the host's environment file sets $RLFLEET_BIND_HOST
(`rlfleet daemon --bind-host`); the spec itself is never rewritten.
"""

from __future__ import annotations

from pydantic import BaseModel

from rlfleet.common.spec.job import JobSpec

BIND_HOST_ENV = "RLFLEET_BIND_HOST"


def with_bind_host(spec: JobSpec, host: str | None) -> JobSpec:
    """`spec` with the `bind_host` of every section that has one set to `host`;
    `spec` itself when `host` is empty."""
    if not host:
        return spec
    changed = {name: section.model_copy(update={"bind_host": host})
               for name, section in spec
               if isinstance(section, BaseModel) and "bind_host" in type(section).model_fields}
    return spec.model_copy(update=changed)
