"""What a benchmark leaves behind: its JSON written whole after every run (a cut bench
keeps the runs it finished), its plot, and an exit status that says whether every run
was valid."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_json(path: Path, payload: Any) -> None:
    """``payload`` as indented JSON at ``path``, replaced whole (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def finish(records: list[dict[str, Any]], json_path: Path, plot_path: Path | None,
           plot: Callable[[list[dict[str, Any]], Path], None]) -> int:
    """Draw the plot when one was asked for, say where the files went; 0 when every run
    is valid, 1 when any is void."""
    if plot_path:
        plot(records, plot_path)
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    return 0 if all(r["valid"] for r in records) else 1
