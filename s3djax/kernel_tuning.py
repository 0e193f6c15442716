"""The CPU matmul's blocking (how far ahead it prefetches, its K chunk, the rows a tile holds, a few rows' panels),
chosen on the machine at hand: the blocking picked by hand on a Zen 4 left multi-row products on an Intel Xeon far
slower than that CPU's own (docs/kernels.md#blocking). No blocking changes a result (each output element is one fma
chain over K).

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
# The search, in stages, each over every combination of its settings' candidates at the rows they matter for, on
# fp32 or bfloat16 weights (the earlier stages' choices held): prefetching for a one-token step and a small verify,
# with the panels a tile of few rows takes (two keep twice the fma chains in flight but split the columns into half
# as many tiles, docs/kernels.md#a-lone-row; up to 3 rows on AVX-512, docs/kernels.md#a-few-rows); then the K chunk
# (where a tile has several register blocks) with the rows a tile holds (where a product has more rows than 16),
# which interact: a tile of 17 rows passes over each chunk three times; then, where the vector unit
# multiplies bfloat16 pairs (`matmul.pair_dot()`), whether its pair instruction beats widening each pair (on the
# Intel Xeon of issue 68 it is slower, docs/kernels.md#bfloat16-pairs).
SEARCH = (({"prefetch": (0, 1024, 2048, 4096, 8192), "row_panels": (1, 2)}, (1, 3, 5), "fp32"),
          ({"chunk_bytes": (8 << 10, 16 << 10, 32 << 10, 64 << 10), "tile_rows": (16, 32)}, (9, 17), "fp32"),
          ({"pair_dot": (0, 1)}, (5, 17), "bf16"))
K, N = 576, 1536          # SmolLM2's hidden and MLP widths
ROUNDS, REPEATS = 3, 1    # every candidate in turn ROUNDS times, the fastest kept
MIN_BYTES, MAX_BYTES = 64 << 20, 1 << 30


def stages(pair_dot: bool) -> tuple:
    """SEARCH's stages a CPU has a choice in: the pair instruction's only where its vector unit has one."""
    return tuple(stage for stage in SEARCH if pair_dot or "pair_dot" not in stage[0])


def choose(time_ms, start: dict, pair_dot: bool = True) -> dict:
    """The blocking SEARCH finds from `start` where `time_ms(blocking, m, weights)` gives the milliseconds of a product
    over fp32 or bf16 weights: in each of the `stages`, the combination with the least summed slowdown (time over the
    stage's fastest) over its rows, the first listed among equals."""
    best = dict(start)
    for settings, rows, weights in stages(pair_dot):
        candidates = [dict(zip(settings, values)) for values in itertools.product(*settings.values())]
        times = [{m: float("inf") for m in rows} for _ in candidates]
        for _ in range(ROUNDS):
            for c, t in zip(candidates, times):
                for m in rows:
                    t[m] = min(t[m], time_ms({**best, **c}, m, weights))
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
    w = np.empty(min(MAX_BYTES, max(MIN_BYTES, 2 * llc)) // per * per // 4, np.float32)
    # One buffer holds either weights: 0.01 in fp32, or in bfloat16 (0x3C24), each a normal number.
    fill = {"fp32": lambda: w.fill(0.01), "bf16": lambda: w.view(np.uint16).fill(0x3C24)}
    filled = [None]

    def time_ms(blocking: dict, m: int, weights: str) -> float:
        if filled[0] != weights:
            fill[weights]()
            filled[0] = weights
        matmul.set_blocking(blocking)
        return matmul.time_products(w, m, K, N, REPEATS, bf16=weights == "bf16")

    try:
        return choose(time_ms, fallback(), matmul.pair_dot())
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
