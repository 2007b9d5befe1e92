"""examples/arithmetic-vllm.toml end to end: `rlfleet run` with every daemon from this
venv and the rollout on vLLM, shortened to a few steps. The trainer's versions reach the
rollout through the relay's shared memory and are loaded into the running vLLM engine
between requests; the run ends with the accounting invariant holding.

Run by `make test-vllm` (.venv-vllm); skipped under the main .venv.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from rlfleet.tools.exit_codes import Exit
from tests.vllm_support import needs_vllm

from .helpers import REPO, TINY_MODEL

pytestmark = needs_vllm

STEPS = 6


def shortened(tmp_path: Path) -> Path:
    text = (REPO / "examples" / "arithmetic-vllm.toml").read_text()
    for key, value in [("path", f'"{TINY_MODEL}"'), ("runs_dir", f'"{tmp_path / "runs"}"'),
                       ("max_steps", str(STEPS)), ("eval_size", "16"), ("eval_every_steps", "3"),
                       ("lease_ttl_s", "2.0"), ("retry_timeout_s", "0.5")]:
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
        assert n == 1, key
    spec = tmp_path / "arithmetic-vllm.toml"
    spec.write_text(text)
    return spec


def test_the_arithmetic_example_trains_on_the_vllm_engine(tmp_path, etcd):
    spec = shortened(tmp_path)
    done = subprocess.run([sys.executable, "-m", "rlfleet.tools.cli", "run", str(spec), "--no-view",
                           "--etcd", etcd.endpoints_arg, "--max-idle-s", "240"],
                          capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == Exit.OK, out[-4000:]
    run_dir = Path(done.stdout.splitlines()[0].removeprefix("run dir: "))
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["ok"] is True and accounting["trained"] >= STEPS * 32 // 8, accounting
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, STEPS + 1))
    log = [json.loads(x) for x in (run_dir / "logs" / "rollout-0.log").read_text().splitlines()
           if x.startswith("{")]
    messages = [x["msg"] for x in log]
    assert any("engine vllm" in m for m in messages), messages
    loaded = [int(v) for m in messages for v in re.findall(r"loaded weight version (\d+)", m)]
    assert loaded and max(loaded) >= STEPS - 2, messages  # versions came in while it served
    assert not [x for x in log if x["level"] == "error"], [x["msg"] for x in log if x["level"] == "error"]
