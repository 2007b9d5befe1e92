"""A fake trainer endpoint (a real ReliableReceiver) and trajectory builders."""

from __future__ import annotations

import threading

from rlfleet.common.wire.arrays import Float32Array, Int32Array
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn
from rlfleet.common.wire.reliable import ReliableReceiver
from rlfleet.daemons.tasks import Prompt


class FakeTrainer:
    """Receives ScoredTrajectory, keeps every copy, acks (unless told to refuse)."""

    def __init__(self) -> None:
        self.receiver = ReliableReceiver("tcp://127.0.0.1:0", expect=ScoredTrajectory, name="fake-trainer")
        self.address = self.receiver.endpoint
        self.copies: list[ScoredTrajectory] = []
        self.refuse: set[str] = set()
        self.hold = threading.Event()  # set: receive and keep, but ack nothing (work piles up upstream)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-trainer")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, msg in self.receiver.drain(0.02):
                    with self._lock:
                        self.copies.append(msg)  # journaled, then acked
                    if self.hold.is_set():
                        continue  # the sender re-sends it: dedup by id makes that harmless
                    if key in self.refuse:
                        self.receiver.ack([key], ok=False, error="trainer says no")
                    else:
                        self.receiver.ack([key])
        finally:
            self.receiver.close()

    def unique(self) -> dict[str, ScoredTrajectory]:
        """After dedup by trajectory id, as the trainer does."""
        with self._lock:
            out: dict[str, ScoredTrajectory] = {}
            for s in self.copies:
                out.setdefault(s.trajectory.trajectory_id, s)
            return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def trajectory(prompt: Prompt, prompt_id: int, k: int, text: str, dropped: str = "",
               with_prompt: bool = True) -> Trajectory:
    turn = Turn(Int32Array([1, 5, 6]), Int32Array([7, 2]), Float32Array([-0.5, -0.1]), 0,
                prompt.question, text)
    return Trajectory(f"p{prompt_id}-g{k}", prompt_id, f"p{prompt_id}", prompt.task, [turn], 0.0,
                      {}, dropped, prompt=prompt if with_prompt else None)


def answered_pairs(task, n: int, seed: int) -> tuple[list[Prompt], list[Trajectory]]:
    """``n`` training prompts of ``task`` and two trajectories each, one in three of them
    answering "7" instead of the answer (so rewards differ)."""
    prompts = task.make_prompts("train", n, seed=seed)
    return prompts, [trajectory(p, i, k, p.answer if (i + k) % 3 else "7")
                     for i, p in enumerate(prompts) for k in range(2)]
