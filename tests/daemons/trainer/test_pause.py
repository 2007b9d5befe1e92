"""Maintenance mode in the training worker (docs/operations/maintenance-mode.md): held at a step
boundary with its version checkpointed, still journaling and acknowledging what
arrives, and going on from there when resumed."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from rlfleet.common.control.keys import JobKeys
from tests.integration.helpers import wait_for

from .test_worker import pair, send, start_worker


def test_a_paused_worker_checkpoints_keeps_receiving_and_resumes_where_it_stopped(
        tmp_path, etcd, tiny_model, monkeypatch):
    monkeypatch.delenv("RLFLEET_RUN_DIR", raising=False)
    w, sender, recorder, store, run_dir = start_worker(tmp_path, etcd, tiny_model)  # checkpoint_every 2
    try:
        send(sender, pair(0, 0) + pair(1, 0))
        wait_for("version 1", lambda: w.version == 1)
        assert w.checkpoint_version == 0 and not w.paused

        w.set_paused(True)
        wait_for("paused", lambda: w.paused)
        # Not due by checkpoint_every (2), written because the job paused.
        assert (w.version, w.checkpoint_version, w.status) == (1, 1, "paused")
        assert store.get(JobKeys("tw").trainer_checkpoint).value["version"] == 1
        assert REGISTRY.get_sample_value("rlfleet_trainer_paused") == 1

        # A batch that arrives while paused is journaled and acknowledged, not trained.
        send(sender, pair(2, 1) + pair(3, 1))
        wait_for("the batch pending in the journal", lambda: {"p2", "p3"} <= set(w._journal.state.pending))
        held_from = time.monotonic()
        wait_for("2 s held at version 1", lambda: w.version == 1 and w.paused
                 and time.monotonic() - held_from > 2.0, timeout_s=10)
        assert w.counts["new"] == 8  # every trajectory received counts, paused or not

        w.set_paused(False)
        wait_for("version 2 after the resume", lambda: w.version == 2)
        assert not w.paused and REGISTRY.get_sample_value("rlfleet_trainer_paused") == 0
        assert set(w._journal.state.trained) == {"p0", "p1", "p2", "p3"} and not w._journal.state.pending
        wait_for("version 2 published", lambda: recorder.versions[-1:] == [2])
        assert recorder.versions == [1, 2]  # no version skipped or published twice by the pause
    finally:
        sender.close()
        w.stop()
        assert w.join(30)
        store.close()


def test_a_worker_started_paused_trains_nothing_until_resumed(tmp_path, etcd, tiny_model, monkeypatch):
    monkeypatch.delenv("RLFLEET_RUN_DIR", raising=False)
    w, sender, recorder, store, run_dir = start_worker(tmp_path, etcd, tiny_model, paused=True)
    try:
        wait_for("paused at version 0", lambda: w.paused and w.version == 0)
        send(sender, pair(0, 0) + pair(1, 0))
        held_from = time.monotonic()
        wait_for("2 s held at version 0", lambda: w.version == 0 and time.monotonic() - held_from > 2.0,
                 timeout_s=10)
        w.set_paused(False)
        wait_for("version 1 after the resume", lambda: w.version == 1)
    finally:
        sender.close()
        w.stop()
        assert w.join(30)
        store.close()
