"""How many bytes a version of the job's weights is on the relay chain.

The trainer publishes float32 copies of every parameter (daemons/trainer/learner.py,
whatever dtype the checkpoint stores); the sim backend publishes `weight_mib`. The
relay's ceiling on what a peer may offer (`[relay] max_object_mib`) defaults to a
multiple of this, and the spec refuses a ceiling below it.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

_ITEMS_HEADER_MAX = 100 << 20  # safetensors caps its JSON header at 100 MB


def model_float32_bytes(model_dir: str | Path) -> int | None:
    """float32 bytes of the parameters in `model_dir`'s *.safetensors files (None: unreadable).

    Reads only each file's JSON header (shapes), never the tensors."""
    total, seen = 0, False
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > _ITEMS_HEADER_MAX:
                    return None
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                total += 4 * math.prod(int(d) for d in entry.get("shape", ()))
                seen = True
    return total if seen else None


def published_bytes(spec: Any) -> int | None:
    """Bytes of one published version for this spec's trainer (None: not known)."""
    weight_mib = getattr(spec.trainer.backend, "weight_mib", None)
    if isinstance(weight_mib, int):  # the sim backend publishes exactly this much
        return weight_mib << 20
    return model_float32_bytes(spec.model.path)
