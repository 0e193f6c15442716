"""The CPU matmul's blocking (how far ahead it prefetches, its K chunk, the rows a tile holds), chosen on the machine
at hand: the blocking picked by hand on a Zen 4 left multi-row products on an Intel Xeon far slower than that CPU's
own (docs/kernels.md#blocking). No blocking changes a result (each output element is one fma chain over K).

The first time the kernel runs on a machine it times a few blockings on products the size of SmolLM2's layers over
weights larger than the last-level cache (a second or two; one line says so), and caches the choice in the user's
cache (`kernel-blocking.json`) by machine (CPU model, cores, cache sizes, jax), kernel build and search space.
S3DJAX_DEFAULTS is the switch, as for the methods' defaults: `again` measures anew, `fixed` takes
configs/defaults.yaml's `cpu_kernel`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import sys
import time

from s3djax import defaults, device, user_cache

TABLE = "kernel-blocking.json"
# The search, in stages, each over every combination of its settings' candidates at the rows they matter for (the
# earlier stages' choices held): prefetching for a one-token step and a small verify; then the K chunk (where a
# tile has several register blocks) with the rows a tile holds (where a product has more rows than 16), which
# interact: a tile of 17 rows passes over each chunk three times.
SEARCH = (({"prefetch": (0, 1024, 2048, 4096, 8192)}, (1, 5)),
          ({"chunk_bytes": (8 << 10, 16 << 10, 32 << 10, 64 << 10), "tile_rows": (16, 32)}, (9, 17)))
K, N = 576, 1536          # SmolLM2's hidden and MLP widths
ROUNDS, REPEATS = 3, 1    # every candidate in turn ROUNDS times, the fastest kept
MIN_BYTES, MAX_BYTES = 64 << 20, 1 << 30


def choose(time_ms, start: dict) -> dict:
    """The blocking SEARCH finds from `start` where `time_ms(blocking, m)` gives a product's milliseconds: in each
    stage, the combination with the least summed slowdown (time over the stage's fastest) over its rows, the first
    listed among equals."""
    best = dict(start)
    for settings, rows in SEARCH:
        candidates = [dict(zip(settings, values)) for values in itertools.product(*settings.values())]
        times = [{m: float("inf") for m in rows} for _ in candidates]
        for _ in range(ROUNDS):
            for c, t in zip(candidates, times):
                for m in rows:
                    t[m] = min(t[m], time_ms({**best, **c}, m))
        fastest = {m: min(t[m] for t in times) for m in rows}
        score = [sum(t[m] / fastest[m] for m in rows) for t in times]
        best.update(candidates[score.index(min(score))])
    return best


def describe(blocking: dict) -> str:
    """"prefetch 4096, chunk_bytes 16384, tile_rows 32": a blocking as the stderr line and `infer.tune` name it."""
    return ", ".join(f"{k} {v}" for k, v in blocking.items())


def fallback() -> dict:
    return dict(defaults.fallback("cpu_kernel"))


def measure() -> dict:
    """The blocking `choose` finds on this machine, timing the kernel itself over weights twice the last-level cache
    (so they come from memory, as a model's do)."""
    import numpy as np

    from cpu_kernels import matmul

    llc = max(device.cpu_caches().values(), default=MIN_BYTES)
    per = K * N * 4
    w = np.full(min(MAX_BYTES, max(MIN_BYTES, 2 * llc)) // per * per // 4, 0.01, np.float32)

    def time_ms(blocking: dict, m: int) -> float:
        matmul.set_blocking(blocking)
        return matmul.time_products(w, m, K, N, REPEATS)

    try:
        return choose(time_ms, fallback())
    finally:
        matmul.set_blocking(fallback())


def _key() -> str:
    from cpu_kernels import matmul

    text = json.dumps([device.describe(), defaults.file_sha256(str(matmul.LIBRARY)), SEARCH, K, N])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _valid(entry) -> bool:
    from cpu_kernels import matmul

    return all(isinstance(entry.get(k), int) for k in matmul.BLOCKING)


@functools.cache
def ensure() -> dict | None:
    """Sets the kernel's blocking for this machine (measured once, then cached), and returns it; None where the kernel
    does not run."""
    from cpu_kernels import matmul

    if not matmul.usable():
        return None
    if defaults.mode() == "fixed":
        chosen = fallback()
    else:
        key, table = _key(), user_cache.read_table(TABLE, _valid)
        entry = table.get(key)
        if entry is None or defaults.mode() == "again":
            print("tuning the CPU matmul's blocking on this machine (once)...", file=sys.stderr, end="", flush=True)
            start = time.perf_counter()
            chosen = measure()
            print(f" {time.perf_counter() - start:.1f} s: {describe(chosen)}", file=sys.stderr)
            table[key] = {**chosen, "device": device.describe()}
            user_cache.write_table(TABLE, table)
        else:
            chosen = {k: entry[k] for k in matmul.BLOCKING}
    matmul.set_blocking(chosen)
    return chosen
