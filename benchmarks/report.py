"""Where benchmark tables go: printed, and written under the results folder named for the device."""

from __future__ import annotations

import os
import sys

import time

import jax
import jax.numpy as jnp
import numpy as np


def device_slug() -> str:
    """The device in a file name: "cpu", or the accelerator's kind ("nvidia-h100-80gb-hbm3")."""
    dev = jax.devices()[0]
    return "cpu" if dev.platform == "cpu" else kind_slug(dev.device_kind)


def kind_slug(kind: str) -> str:
    """A device kind ("NVIDIA H100 80GB HBM3") as it goes in a file name."""
    return kind.replace(" ", "-").lower()


def timing_args(module: str, doc: str, repeats: int):
    """The flags of a timing benchmark that writes one table: --repeats (at least 1) and --out."""
    from s3djax.cli import Parser

    p = Parser(prog=f"python -m {module}", description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    p.check(args, repeats=args.repeats >= 1)
    return args


def write(out_dir: str, name: str, table: str) -> str:
    print(table)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{device_slug()}.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def median_us(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e6)


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a device-memory copy (read + write): the ceiling a bandwidth-bound step is held to."""
    x = jnp.ones((64 * 2**20,), jnp.float32)
    us = median_us(jax.jit(lambda a: a + 1), x, repeats=repeats)
    return 2 * x.nbytes / (us * 1e-6)
