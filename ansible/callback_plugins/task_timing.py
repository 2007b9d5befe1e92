"""Ansible callback: how long each task took (wall time, all hosts together), the slowest
listed at the end of the play recap, so a slow `site.yml` says where its time goes.

Enabled by ansible.cfg (`callbacks_enabled = task_timing`). `RLFLEET_TASK_TIMING_TOP`
sets how many tasks are listed (default 15; 0 lists none). A task's time runs from its
start to the next task's start (or the end of the run): with forks it is the slowest
host's time, which is what the run waits for.
"""

from __future__ import annotations

import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
    name: task_timing
    type: aggregate
    short_description: the slowest tasks of a run, by wall time
    description: Lists the slowest tasks (wall time, all hosts together) after the recap.
    requirements: [enabled in callbacks_enabled]
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_timing"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._timings: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None
        self._started = time.monotonic()

    def _close(self) -> None:
        if self._current is not None:
            name, t0 = self._current
            self._timings.append((name, time.monotonic() - t0))
            self._current = None

    def _start(self, task) -> None:
        self._close()
        self._current = (task.get_name().strip(), time.monotonic())  # "role : task" for a role's task

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._start(task)

    def v2_playbook_on_handler_task_start(self, task) -> None:
        self._start(task)

    def v2_playbook_on_stats(self, stats) -> None:
        self._close()
        top = int(os.environ.get("RLFLEET_TASK_TIMING_TOP", "15"))
        if top <= 0:
            return
        total = time.monotonic() - self._started
        slowest = sorted(self._timings, key=lambda kv: -kv[1])[:top]
        self._display.display(f"TASK TIMING: {total:.1f} s in all; the {len(slowest)} slowest tasks:")
        for name, seconds in slowest:
            self._display.display(f"  {seconds:7.1f} s  {name}")
