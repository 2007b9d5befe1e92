"""Real daemons for the fuzz tests: a subprocess per daemon against a real etcd, its
member record read for the data-plane address and the /metrics URL, and the rejection
counter scraped from that URL."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from tests.integration.helpers import rlfleet, stop, wait_for, write_spec

REJECTED = "rlfleet_rejected_messages_total"


class DaemonProcess:
    """``rlfleet daemon <role>`` as a subprocess; ``record()`` is its member value."""

    def __init__(self, tmp_path: Path, etcd: Any, role: str, member_id: str, job: str,
                 spec: str, *, model: Path | None = None) -> None:
        self.role, self.id, self.job = role, member_id, job
        self.keys = JobKeys(job)
        self.store = EtcdStore(etcd.endpoints)
        kwargs = {"model": model} if model is not None else {}
        self.spec_path = write_spec(tmp_path, job, spec, **kwargs)
        self.log = tmp_path / f"{role}-{member_id}.log"
        self.proc: subprocess.Popen[bytes] = rlfleet(
            "daemon", role, "--job", job, "--etcd", etcd.endpoints_arg, "--id", member_id,
            "--spec", str(self.spec_path), log=self.log)

    def record(self) -> dict[str, Any] | None:
        kv = self.store.get(self.keys.member(self.role, self.id))
        if kv and kv.value.get("pid") == self.proc.pid and kv.value.get("state") == "running":
            return kv.value  # type: ignore[no-any-return]
        return None

    def address(self, name: str, timeout_s: float = 60.0) -> str:
        return wait_for(f"{self.role} {self.id} publishing {name}",
                        lambda: (self.record() or {}).get("addresses", {}).get(name),
                        timeout_s=timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rejected(self, **labels: str) -> float:
        """Sum of rlfleet_rejected_messages_total over the series matching ``labels``."""
        record = self.record()
        assert record is not None, self.tail()
        return scrape(record["metrics"], REJECTED, **labels)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def close(self) -> int:
        try:
            return stop(self.proc)
        finally:
            self.store.close()


_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')


def scrape(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total
