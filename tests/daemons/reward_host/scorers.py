"""Reward functions that misbehave, for the worker-pool tests (loaded in the workers by path)."""

from __future__ import annotations

import os
import time


def faulty(task, prompt, texts):
    """task.reward, except on magic completions."""
    first = texts[0] if texts else ""
    if first == "raise":
        raise ZeroDivisionError("the reward rule divided by zero")
    if first == "loop":
        while True:  # a rule that never finishes: only SIGKILL stops it
            pass
    if first == "exit":
        os._exit(7)
    if first == "nan":
        return float("nan")
    if first == "print":
        print("stray output must not corrupt the worker protocol")
    if first == "slow":
        time.sleep(0.3)
    return task.reward(prompt, texts)
