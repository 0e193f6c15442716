"""Naming the device a figure was measured on."""

from __future__ import annotations

import os

import jax


def cpu_name(cpuinfo: str) -> str:
    """The model name, with family, model and widest vector unit: a virtual machine's "AMD EPYC" alone
    names CPUs of several generations, and their small-matrix speeds differ by 2x."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    simd = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), None)
    detail = ", ".join(x for x in (fields.get("cpu family") and f"family {fields['cpu family']} model {fields.get('model')}",
                                   simd) if x)
    return fields.get("model name", "cpu") + (f" ({detail})" if detail else "")


def describe() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                name = cpu_name(f.read())
        except OSError:
            name = "cpu"
        return f"CPU: {name}, {os.cpu_count()} cores (jax {jax.__version__})"
    return f"{dev.platform.upper()}: {dev.device_kind} (jax {jax.__version__})"


def memory_bytes(stat: str) -> int | None:
    """A device memory statistic ("peak_bytes_in_use": the most allocated so far; "bytes_in_use": now),
    or None where the backend keeps no statistics (CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get(stat)
