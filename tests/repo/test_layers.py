"""Layers: common <- relay <- daemons <- tools, and no daemon imports another daemon;
inside common, its small shared modules <- spec <- {control, wire, sandbox} <- daemon,
security, with no edge between control, wire and sandbox.

Every module's imports are read with `ast` (module-level and inside functions,
absolute and relative), resolved to rlfleet module names, and checked:

- a module may import only from its own layer or a lower one;
- inside common (COMMON_LAYERS): a module imports only from its own sub-package or a
  lower level, and the sub-packages of one level (control, wire, sandbox: the etcd
  plane, the data plane, the sandbox) do not import each other; common's top-level
  modules are level 0 (small shared ones) unless listed (daemon, security: they
  assemble the others);
- a module inside one daemon's package (rlfleet.daemons.<daemon>) may not import
  another daemon's package. Shared libraries of the daemons layer (SHARED below,
  e.g. rlfleet.daemons.tasks) and rlfleet.daemons itself are not daemons: any
  daemon may import them, and they may import no daemon.

A violation names the importing file:line and the imported module, so the fix
starts where the message points. The checker is tested on a small synthetic tree
first, so an empty result cannot come from a checker that sees nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rlfleet"
LAYERS = {"common": 0, "relay": 1, "daemons": 2, "tools": 3}  # folder = rlfleet.<folder>
SHARED = {"tasks"}  # rlfleet.daemons.<name> that are libraries, not daemons
# rlfleet.common.<name>: its level; unlisted top-level modules are 0 (docs/design/layout.md).
COMMON_LAYERS = {"spec": 1, "control": 2, "wire": 2, "sandbox": 2, "daemon": 3, "security": 3}
COMMON_PACKAGES = {"spec", "control", "wire", "sandbox"}


def module_of(root: Path, path: Path) -> tuple[str, bool]:
    """('rlfleet.daemons.trainer.worker', is_package) for a file under root/<layer>/."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join([PACKAGE, *parts]), is_package


def exists(root: Path, module: str) -> bool:
    """A module or package of the tree (not a name inside a module)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in LAYERS:
        return False
    base = root.joinpath(*parts[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported rlfleet module) for every import statement anywhere in the file."""
    module, is_package = module_of(root, path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level - 1 >= len(base_parts):
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond {PACKAGE}")
                base = ".".join(base_parts[:len(base_parts) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the submodule pkg.sub when there is one.
                sub = f"{source}.{alias.name}"
                yield node.lineno, sub if exists(root, sub) else source


def _daemon_of(module: str) -> str | None:
    """The daemon package a module belongs to (None: not inside one daemon)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == [PACKAGE, "daemons"] and parts[2] not in SHARED:
        return parts[2]
    return None


def edge_problem(importer: str, imported: str) -> str | None:
    """Why importer may not import imported, or None when it may."""
    src_parts, dst_parts = importer.split("."), imported.split(".")
    if dst_parts[0] != PACKAGE or len(dst_parts) < 2 or dst_parts[1] not in LAYERS:
        return None  # the standard library, third parties, or the bare namespace
    src, dst = LAYERS[src_parts[1]], LAYERS[dst_parts[1]]
    if dst > src:
        return f"upward: {src_parts[1]} (layer {src}) imports {dst_parts[1]} (layer {dst})"
    if src == dst == LAYERS["common"] and len(src_parts) > 2 and len(dst_parts) > 2:
        a, b = src_parts[2], dst_parts[2]
        la, lb = COMMON_LAYERS.get(a, 0), COMMON_LAYERS.get(b, 0)
        if lb > la:
            return f"upward: common.{a} (level {la}) imports common.{b} (level {lb})"
        if la == lb and a != b and a in COMMON_PACKAGES and b in COMMON_PACKAGES:
            return f"sideways: common.{a} imports common.{b} (level {la})"
    a, b = _daemon_of(importer), _daemon_of(imported)
    if src == LAYERS["daemons"] and b is not None and a != b:  # tools may use any daemon
        return f"sideways: {'daemon ' + a if a else importer} imports daemon {b}"
    return None


def violations(root: Path) -> list[str]:
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            importer, _ = module_of(root, path)
            for line, imported in imports_of(root, path):
                problem = edge_problem(importer, imported)
                if problem:
                    found.append(f"{path.relative_to(root)}:{line}: imports {imported} ({problem})")
    return found


# ---------------------------------------------------------------------------- the checker
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_every_kind_of_bad_edge_and_passes_good_ones(tmp_path):
    root = _tree(tmp_path, {
        "common/__init__.py": "",
        "common/wire.py": "import json\n",
        "common/bad.py": "def f():\n    from rlfleet.relay import reader\n",   # upward, in a function
        "common/spec/__init__.py": "",
        "common/logs.py": "",
        "common/spec/job.py": "from rlfleet.common import logs\n",              # fine: a level-0 module
        "common/spec/bad.py": "from rlfleet.common.control import keys\n",     # upward inside common
        "common/control/__init__.py": "",
        "common/control/keys.py": "from ..spec import job\n",                  # fine: downward
        "common/control/bad.py": "from rlfleet.common.sandbox import parent\n",  # sideways inside common
        "common/sandbox/__init__.py": "",
        "common/sandbox/parent.py": "",
        "common/daemon.py": "from .control import keys\nfrom .sandbox import parent\n",  # fine: the top
        "relay/__init__.py": "",
        "relay/reader.py": "from ..common import wire\n",                        # fine
        "relay/bad.py": "import rlfleet.daemons.trainer\n",                       # upward
        "daemons/__init__.py": "",
        "daemons/tasks/__init__.py": "from rlfleet.common.wire import json\n",    # fine
        "daemons/tasks/bad.py": "from rlfleet.daemons.trainer import worker\n",  # library -> daemon
        "daemons/trainer/__init__.py": "",
        "daemons/trainer/worker.py": "from . import journal\nfrom ..tasks import x\n"  # fine
                                     "from .. import env_host\n",                # sideways, relative
        "daemons/trainer/journal.py": "",
        "daemons/env_host/__init__.py": "",
        "daemons/env_host/outbox.py": "from ...tools import cli\n",               # upward, relative
        "tools/__init__.py": "",
        "tools/cli.py": "from rlfleet.daemons.env_host import outbox\nimport rlfleet.relay.reader\n",
    })
    assert violations(root) == [
        "common/bad.py:2: imports rlfleet.relay.reader (upward: common (layer 0) imports relay (layer 1))",
        "common/control/bad.py:1: imports rlfleet.common.sandbox.parent "
        "(sideways: common.control imports common.sandbox (level 2))",
        "common/spec/bad.py:1: imports rlfleet.common.control.keys "
        "(upward: common.spec (level 1) imports common.control (level 2))",
        "relay/bad.py:1: imports rlfleet.daemons.trainer (upward: relay (layer 1) imports daemons (layer 2))",
        "daemons/env_host/outbox.py:1: imports rlfleet.tools.cli "
        "(upward: daemons (layer 2) imports tools (layer 3))",
        "daemons/tasks/bad.py:1: imports rlfleet.daemons.trainer.worker "
        "(sideways: rlfleet.daemons.tasks.bad imports daemon trainer)",
        "daemons/trainer/worker.py:3: imports rlfleet.daemons.env_host "
        "(sideways: daemon trainer imports daemon env_host)",
    ]


def test_the_checker_reads_the_real_tree():
    # Guards against a vacuous pass: the walk must see known edges of the real tree.
    seen = {(module_of(ROOT, p)[0], imported)
            for layer in LAYERS for p in (ROOT / layer).rglob("*.py")
            for _, imported in imports_of(ROOT, p)}
    assert ("rlfleet.daemons.trainer.worker", "rlfleet.daemons.trainer.journal") in seen
    assert ("rlfleet.tools.cli", "rlfleet.tools.run.supervisor") in seen  # inside a function
    assert len(seen) > 200


def test_no_module_imports_upward_or_from_another_daemon():
    found = violations(ROOT)
    assert not found, "layer violations:\n" + "\n".join(found)
