"""What a machine has: CPUs, memory, GPUs (where nvidia-smi answers)."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import psutil


def gpus() -> list[dict[str, Any]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    found = []
    for line in out.strip().splitlines():
        try:
            index, name, mem_mib = (x.strip() for x in line.split(","))
            found.append({"index": int(index), "name": name, "memory_bytes": int(float(mem_mib)) * 2**20})
        except ValueError:  # a line this query does not print ("No devices were found"): not a GPU
            continue
    return found


def machine_inventory(host: str) -> dict[str, Any]:
    mem = psutil.virtual_memory()
    return {
        "host": host,
        "cpus_logical": psutil.cpu_count(logical=True),
        "cpus_physical": psutil.cpu_count(logical=False),
        "memory_bytes": mem.total,
        "memory_available_bytes": mem.available,
        "gpus": gpus(),
        "boot_time": psutil.boot_time(),
        "seen": round(time.time(), 3),
    }
