"""The rollout daemon: an inference engine with continuous batching, serving generation requests.

setup() loads the model of spec.model.path into the engine named by
spec.rollout.engine (through the engine registry), binds a RequestServer (published as ``addresses["requests"]``)
and starts the engine thread (``loop.EngineLoop``), which owns the engine and the
socket; cycle() only reports what that thread did (weight-version changes) and
notices if it died. Weight versions come from the local relay through
``rlfleet.relay.reader.WeightReader``; without that module the rollout serves
version 0, the checkpoint on disk.

Threads: ``torch.set_num_threads`` from RLFLEET_TORCH_THREADS (default 1). Whoever
starts several daemons on one machine sets it so that the torch threads of all of
them together do not exceed the machine's cores.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rlfleet.common.daemon import Daemon
from rlfleet.common.sockets import RequestServer
from rlfleet.common.wire import Abort, GenerateRequest, RolloutStats

log = logging.getLogger("rlfleet.rollout")

THREADS_ENV = "RLFLEET_TORCH_THREADS"


def torch_threads(environ: dict[str, str] | None = None) -> int:
    """The torch intra-op thread count from RLFLEET_TORCH_THREADS (default 1)."""
    raw = (os.environ if environ is None else environ).get(THREADS_ENV, "1").strip() or "1"
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {n}")
    return n


class Rollout(Daemon):
    role = "rollout"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop: Any = None  # EngineLoop, once set up
        self.server: RequestServer | None = None

    def setup(self) -> None:
        import torch  # here, not at import: `rlfleet daemon --help` stays instant

        from rlfleet.common.seams import ROLLOUT_ENGINES

        from .loop import EngineLoop

        assert self.spec is not None
        threads = torch_threads()
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)  # the engine runs one op at a time
        except RuntimeError:
            pass  # already set in this process
        rs = self.spec.rollout
        engine = ROLLOUT_ENGINES.build(rs.engine, model_path=self.spec.model.path,
                                       dtype=self.spec.model.dtype)
        self.server = RequestServer(f"tcp://{rs.bind_host}:0",
                                    expect=(GenerateRequest, Abort, RolloutStats),
                                    name=f"{self.options.member_id}-requests")
        self.addresses["requests"] = self.server.endpoint
        self.loop = EngineLoop(engine, self.server, self.options.member_id, self._make_reader)
        self.loop.start()
        log.info("serving %s on %s: engine %s, max_batch %d, cache %d tokens/slot, %d torch thread(s)",
                 self.spec.model.path, self.server.endpoint, rs.engine.kind, getattr(engine, "max_batch", 0),
                 getattr(engine, "max_len", 0), threads, extra={"event": "serving"})

    def _make_reader(self) -> Any:
        """The local relay's reader, or None when this installation has no relay reader."""
        try:
            from rlfleet.relay.reader import WeightReader
        except ImportError as exc:
            log.warning("no weight reader (%s): serving weight version 0, the checkpoint on disk",
                        exc, extra={"event": "no_reader"})
            return None
        return WeightReader(self.store, self.options.job, self.options.host)

    def release(self) -> None:
        """Let the next weight load happen now; running requests end as "abort"."""
        if self.loop is not None:
            self.loop.release()

    def cycle(self) -> str | None:
        if self.loop is None:
            return None
        if not self.loop.alive and self.loop.error is not None:
            # Exit non-zero so the supervisor restarts a clean process: nothing is lost,
            # env-hosts re-issue the turns this rollout held.
            raise RuntimeError(f"engine thread died: {self.loop.error!r}")
        said = []
        while self.loop.events:
            said.append(self.loop.events.popleft())
        return "; ".join(said) or None

    def member_info(self) -> dict[str, Any]:
        return {"weight_version": self.loop.engine.weight_version if self.loop else 0}

    def drain(self) -> str | None:
        if self.loop is None:
            return None
        self.loop.stop()
        stats = self.loop.engine.stats()
        if self.server is not None:
            self.server.close()
        return f"engine stopped at weight version {stats.weight_version}"
