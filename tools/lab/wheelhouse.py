"""`wheelhouse`: every wheel a lab host installs rlfleet from, built on the controller.

The hosts reach no registry, so `pip install --no-index --find-links /srv/wheelhouse
'rlfleet[ml]'` must find everything here: the pinned dependencies with the `ml` extra
(torch==2.13.0 as the CPU build), wheels built from sdists where a project ships no
wheel, and rlfleet's own wheel built from the working tree. The hosts run Debian's
Python 3.11 and glibc, as the controller does, so the controller's pip picks wheels
that fit them.

The dependencies are cached with a stamp of the requirement list; a later run with
the same list rebuilds only rlfleet's wheel (the code changes, the pins rarely do).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from rlfleet.tools.lab.commands import CommandFailed, run, run_long, say
from rlfleet.tools.lab.paths import CACHE, WHEELHOUSE, WHEELHOUSE_STAMP

EXTRAS = ("ml",)
TORCH_PIN = "torch==2.13.0"
# Copying the tree to a scratch folder keeps setuptools' build/ and *.egg-info out of it.
TREE_IGNORE = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "LAB_READY")
FORBIDDEN_PREFIXES = ("nvidia_", "triton-")  # a CUDA torch crept in: the hosts must not get multi-GB GPU wheels


def requirements(repo: Path) -> list[str]:
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return reqs


def build(repo: Path, python: str = sys.executable, force: bool = False) -> dict:
    """Make sure WHEELHOUSE holds the dependencies and a fresh rlfleet wheel; returns the stamp."""
    t0 = time.monotonic()
    reqs = requirements(repo)
    want = {"requirements": reqs, "python": _python_tag(python)}
    log = CACHE / "wheelhouse.log"
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    if force or not _deps_cached(want):
        log.unlink(missing_ok=True)
        for old in WHEELHOUSE.iterdir():
            old.unlink()
        # torch alone first, as the Makefile does: the exact pin resolves to the CPU build, and
        # nothing resolved after it can pull another torch.
        say(f"pip wheel {TORCH_PIN} and {len(reqs) - 1} pinned dependencies into {WHEELHOUSE} (log {log})")
        pip_wheel = [python, "-m", "pip", "wheel", "--wheel-dir", str(WHEELHOUSE), "--find-links", str(WHEELHOUSE)]
        run_long([*pip_wheel, TORCH_PIN], "pip wheel torch", log)
        run_long([*pip_wheel, *reqs], "pip wheel dependencies", log)
        _check_no_gpu_wheels()
        deps_s = time.monotonic() - t0
        _write_stamp({"deps": want, "deps_s": round(deps_s, 1),
                      "dep_wheels": sorted(p.name for p in WHEELHOUSE.glob("*.whl"))})
    else:
        say(f"dependencies cached in {WHEELHOUSE} ({len(list(WHEELHOUSE.glob('*.whl')))} wheels); "
            "rebuilding only rlfleet's wheel")
    wheel = _build_rlfleet_wheel(repo, python, log)
    _check_resolves(python)
    took = time.monotonic() - t0
    stamp = {**_stamp(), "rlfleet_wheel": wheel.name, "last_s": round(took, 1),
             "size_mb": round(sum(p.stat().st_size for p in WHEELHOUSE.iterdir()) / 2**20)}
    _write_stamp(stamp)
    say(f"wheelhouse ready in {took:.0f} s: {WHEELHOUSE} ({stamp['size_mb']} MB, rlfleet wheel {wheel.name})")
    return stamp


def _build_rlfleet_wheel(repo: Path, python: str, log: Path) -> Path:
    for old in WHEELHOUSE.glob("rlfleet-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="rlfleet-wheel-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(repo, tree, ignore=TREE_IGNORE, symlinks=True)
        run_long([python, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(WHEELHOUSE), str(tree)],
                 "pip wheel rlfleet (working tree)", log)
    wheels = list(WHEELHOUSE.glob("rlfleet-*.whl"))
    if len(wheels) != 1:
        raise CommandFailed(f"expected one rlfleet wheel in {WHEELHOUSE}, found {wheels}")
    return wheels[0]


def _deps_cached(want: dict) -> bool:
    stamp = _stamp()
    return stamp.get("deps") == want and all((WHEELHOUSE / n).exists() for n in stamp.get("dep_wheels", [None]))


def _check_no_gpu_wheels() -> None:
    bad = [p.name for p in WHEELHOUSE.iterdir() if p.name.lower().startswith(FORBIDDEN_PREFIXES)]
    torch = [p.name for p in WHEELHOUSE.glob("torch-*.whl")]
    if bad or not torch or "+cpu" not in torch[0]:
        raise CommandFailed(f"the wheelhouse must hold the CPU torch and no GPU wheels; torch={torch}, gpu={bad}")


def _check_resolves(python: str) -> None:
    """What a host will run, resolved against the wheelhouse alone (nothing installed)."""
    with tempfile.TemporaryDirectory(prefix="rlfleet-resolve-") as tmp:
        run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--no-index",
             "--find-links", str(WHEELHOUSE), "--target", tmp, "rlfleet[ml]"], timeout=300)


def _python_tag(python: str) -> str:
    out = subprocess.run([python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _stamp() -> dict:
    try:
        return json.loads(WHEELHOUSE_STAMP.read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(stamp: dict) -> None:
    WHEELHOUSE_STAMP.parent.mkdir(parents=True, exist_ok=True)
    WHEELHOUSE_STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
