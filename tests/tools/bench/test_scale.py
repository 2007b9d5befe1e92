"""The scale benchmark (tools/bench/scale.py) in its --dry mode: the same path as the
0.5B run (a multi-rank megatron trainer under torchrun, every rank publishing its own
slice, the slices joined into the rollout engine) on a 2-layer shape, one run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'rlfleet[megatron]'")

from rlfleet.tools.bench import scale  # noqa: E402


def test_the_dry_run_trains_publishes_and_loads_at_tensor_parallel_2(tmp_path):
    out = tmp_path / "scale-dry.json"
    assert scale.main(["--json", str(out), "--dry"]) == 0
    record = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(record)
    assert (record["tensor_parallel"], record["data_parallel"], record["runs_ok"]) == (2, 1, 1)
    for key in ("model_params", "step_s", "publish_s", "load_s", "peak_rss_mib", "published_bytes"):
        assert key in record, key
    assert len(record["peak_rss_mib"]) == 2 and all(m > 100 for m in record["peak_rss_mib"])
    assert record["published_bytes"]["bfloat16"] * 2 == record["published_bytes"]["float32"]
    run = record["runs"][0]
    assert sorted(r["tp_rank"] for r in run["ranks"]) == [0, 1]
    assert len({r["loss"] for r in run["ranks"]}) == 1  # both ranks report the whole step's loss
    # the joined version is the whole model: every parameter once, in bfloat16
    assert run["rollout"]["bytes"] == record["model_params"] * 2 and run["rollout"]["generated_tokens"] == 4
