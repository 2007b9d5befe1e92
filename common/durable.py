"""Durability helpers for journals and checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str] | Path) -> None:
    """fsync a file or a directory by path. A new or renamed file is durable
    only once its directory entry is, so callers fsync the directory too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
