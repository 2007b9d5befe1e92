"""The flat layout stays installable: every package folder is listed in pyproject."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for top, name in {v: k for k, v in cfg["package-dir"].items()}.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"unlisted: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_torch_is_pinned_exactly():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    all_deps = deps["dependencies"] + [d for group in deps["optional-dependencies"].values() for d in group]
    torch = [d for d in all_deps if d.startswith("torch")]
    # one pin, written in `ml` and again in `vllm` (an extra for its own venv: not with `ml`)
    assert set(torch) == {"torch==2.13.0"} and len(torch) == 2, torch
