"""Naming the device a figure was measured on."""

from __future__ import annotations

import os

import jax


def describe() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        name = "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        return f"CPU: {name}, {os.cpu_count()} cores (jax {jax.__version__})"
    return f"{dev.platform.upper()}: {dev.device_kind} (jax {jax.__version__})"


def memory_bytes(stat: str) -> int | None:
    """A device memory statistic ("peak_bytes_in_use": the most allocated so far; "bytes_in_use": now),
    or None where the backend keeps no statistics (CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get(stat)
