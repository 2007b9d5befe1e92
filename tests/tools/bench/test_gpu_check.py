"""The device check (tools/bench/gpu.py) in its --dry mode: every part on the CPU with small
shapes, so the script is known to run before the minutes on a GPU machine are spent. The
record has each part's figures, and a part that cannot run says why instead of stopping
the others."""

from __future__ import annotations

import json
import shutil

import pytest

from rlfleet.tools.bench import gpu
from tests.integration.helpers import TINY_MODEL

needs = pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists() or shutil.which("etcd") is None,
                           reason="needs models/tiny-qwen2 and etcd on PATH")


@needs
def test_the_dry_run_measures_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--json", str(out), "--dry"]) == 0
    record = json.loads(out.read_text())
    assert record["dry"] is True and {"command", "commit", "machine", "date"} <= set(record)
    assert record["shape"]["ok"] and record["shape"]["model_params"] > 0
    engine = record["engine"]["by_concurrency"]
    assert set(engine) == {"1", "2"} and all(e["tokens"] == c * 4 for c, e in zip((1, 2), engine.values()))
    assert record["vllm"]["ok"] and record["vllm"]["available"] is False  # not in this venv: said why
    assert "import vllm" in record["vllm"]["why"]
    step = record["train_step"]
    assert step["ok"] and step["step_s"] > 0 and step["published"]["bfloat16"]["bytes"] * 2 == \
        step["published"]["float32"]["bytes"]
    assert record["load"]["ok"] and record["load"]["total_bytes"] >= step["published"]["bfloat16"]["bytes"]
    mega = record["megatron_step"]
    assert mega["ok"] and mega["step_s"] > 0 and mega["precision"] == "bfloat16"
    assert mega["published_bytes"] == step["published"]["bfloat16"]["bytes"]  # the same model, the same dtype
    job = record["job"]
    assert job["ok"] and job["ran"] and job["eval_success_first"] is not None and job["eval_success_last"] is not None


def test_a_part_that_fails_is_recorded_and_the_next_one_runs():
    record: dict = {}

    def boom() -> dict:
        raise RuntimeError("no CUDA here")
    gpu._part(record, "engine", boom)
    gpu._part(record, "load", lambda: {"load_s": 1.0})
    assert record["engine"]["ok"] is False and record["engine"]["error"] == "RuntimeError: no CUDA here"
    assert record["load"] == {"ok": True, "load_s": 1.0, "seconds": record["load"]["seconds"]}
