"""An asyncio event loop on a thread of its own: the env-host's runner lives on it while
the daemon's cycle, the outbox and the claim pacer run on other threads.

What is generic about such a thread is here, apart from the runner's policy: start, a
stop that says where the loop is stuck when it does not end in time, the error that
ended it (the daemon's cycle reports it), every task unwound before the loop closes,
and an optional CPU profile of the thread (RLFLEET_ENV_PROFILE=<file>, written at exit;
tools/bench/env_scale.py --profile).
"""

from __future__ import annotations

import asyncio
import cProfile
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("rlfleet.env_host")


class LoopThread:
    def __init__(self, name: str, main: Callable[[], Awaitable[None]], begin_stop: Callable[[], None],
                 before_unwind: Callable[[], None]) -> None:
        """``main`` runs until it returns; ``begin_stop`` is called on the loop to make it
        return; ``before_unwind`` runs on the loop once it has (close clients, whose
        cancelled requests then unwind with every other task)."""
        self.loop = asyncio.new_event_loop()
        self.error: BaseException | None = None
        self._main, self._begin_stop, self._before_unwind = main, begin_stop, before_unwind
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """From another thread: run ``fn`` on the loop soon (nothing once the loop ended)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout_s: float) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self._begin_stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            frame = sys._current_frames().get(self._thread.ident or 0)
            stack = "".join(traceback.format_stack(frame)) if frame else "?"
            log.error("%s did not stop within %.0f s; it is at:\n%s", self._thread.name, timeout_s, stack)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        profile_to = os.environ.get("RLFLEET_ENV_PROFILE")
        profiler = cProfile.Profile(time.thread_time) if profile_to else None  # CPU, not wall
        if profiler is not None:
            profiler.enable()
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 — reported by the daemon's cycle
            self.error = exc
            log.exception("%s died", self._thread.name)
        finally:
            self.loop.run_until_complete(self._unwind())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile_to)

    async def _unwind(self) -> None:
        self._before_unwind()
        me = asyncio.current_task()
        for _ in range(5):  # cancelling a request spawns its Abort: a few rounds settle it
            pending = [t for t in asyncio.all_tasks() if t is not me]
            if not pending:
                return
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
