"""The log-prob mismatch benchmark (tools/bench/logprob_mismatch.py) in its --dry mode: the
tiny model, one seed, its three engine/trainer pairings measured on the engine's own samples."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'rlfleet[megatron]'")

from rlfleet.tools.bench import logprob_mismatch  # noqa: E402


def test_the_dry_run_measures_every_pairing(tmp_path):
    out = tmp_path / "mismatch.json"
    assert logprob_mismatch.main(["--json", str(out), "--dry"]) == 0
    record = json.loads(out.read_text())
    assert {"command", "commit", "machine", "date"} <= set(record)
    pairs = {(r["engine"], r["trainer"]): r for r in record["rows"]}
    assert set(pairs) == set(logprob_mismatch.PAIRINGS) and all(r["tokens"] == 4 * 8 for r in pairs.values())
    control = pairs[("float32", "float32")]
    # float32 on both sides: the same model, other kernels; bf16 serving moves log-probs far more
    assert control["max_abs_diff"] < 1e-4
    assert pairs[("bfloat16", "float32")]["mean_abs_diff"] > 100 * control["mean_abs_diff"]
    assert set(record["summary"]) == {f"tiny-qwen2: engine {e} vs trainer {t}" for e, t in logprob_mismatch.PAIRINGS}
