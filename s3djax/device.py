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


def cpu_caches(root: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
    """{"L1d": bytes, "L2": bytes, ...}: the first CPU's data and unified caches as sysfs lists them ({} where it
    cannot be read). The last level is shared; the others are per core."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    caches = {}
    try:
        for index in sorted(x for x in os.listdir(root) if x.startswith("index")):
            fields = {}
            for name in ("level", "type", "size"):
                with open(os.path.join(root, index, name)) as f:
                    fields[name] = f.read().strip()
            if fields["type"] == "Instruction":
                continue
            size = fields["size"]
            label = f"L{fields['level']}" + ("d" if fields["type"] == "Data" else "")
            caches[label] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        return {}
    return caches


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10} KiB"


def describe() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                name = cpu_name(f.read())
        except OSError:
            name = "cpu"
        caches = ", ".join(f"{label} {_size(n)}" for label, n in cpu_caches().items())
        return f"CPU: {name}, {os.cpu_count()} cores" + (f", {caches}" if caches else "") + f" (jax {jax.__version__})"
    return f"{dev.platform.upper()}: {dev.device_kind} (jax {jax.__version__})"


def memory_bytes(stat: str) -> int | None:
    """A device memory statistic ("peak_bytes_in_use": the most allocated so far; "bytes_in_use": now),
    or None where the backend keeps no statistics (CPU)."""
    return (jax.devices()[0].memory_stats() or {}).get(stat)
