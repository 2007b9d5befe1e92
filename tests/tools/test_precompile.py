"""`python -m rlfleet.tools.precompile`: the bytecode the daemons load, written once as root.

The real run writes into a PYTHONPYCACHEPREFIX of the test's own, so the repo's venv is left as
it was, and checks the bytecode of modules a daemon loads is there and a module none loads is not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "tiny-qwen2"


def _precompile(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.tools.precompile", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    return {**env, **extra}


def _cached(prefix: Path, module_file: str) -> bool:
    """Whether `prefix` (a PYTHONPYCACHEPREFIX: a tree mirroring the sources') holds bytecode of `module_file`."""
    source = Path(module_file).resolve()
    folder = prefix / source.parent.relative_to("/")
    return any(folder.glob(f"{source.stem}.*.pyc"))


def test_it_writes_the_bytecode_of_what_daemons_and_the_model_load_and_not_of_the_rest(tmp_path):
    done = _precompile("--model", str(MODEL), env=_env(PYTHONPYCACHEPREFIX=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert f"{MODEL}: qwen2 (Qwen2ForCausalLM)" in done.stdout
    import torch
    import transformers.models.bert.modeling_bert as never_loaded
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    import rlfleet.daemons.trainer.daemon as trainer
    import rlfleet.tools.bench.drops as not_a_daemon_module
    for loaded in (trainer, torch, qwen2, not_a_daemon_module):  # rlfleet is compiled whole
        assert _cached(tmp_path, loaded.__file__), loaded.__name__
    assert not _cached(tmp_path, never_loaded.__file__)


def test_a_folder_without_a_model_is_refused_before_any_work(tmp_path):
    done = _precompile("--model", str(tmp_path), env=_env())
    assert done.returncode == 2
    assert f"--model {tmp_path}: no config.json there" in done.stderr


def test_it_refuses_to_run_when_bytecode_would_not_be_written():
    done = _precompile(env=_env(PYTHONDONTWRITEBYTECODE="1"))
    assert done.returncode == 2
    assert "bytecode writing is off" in done.stderr


def test_it_compiles_every_package_the_wheel_holds():
    import tomllib

    from rlfleet.tools.precompile import PACKAGES
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert set(PACKAGES) == set(package_dir)
