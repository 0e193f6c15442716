"""Where benchmark tables go: printed, and written under the results folder named for the device."""

from __future__ import annotations

import os
import sys

import jax


def write(out_dir: str, name: str, table: str) -> str:
    print(table)
    dev = jax.devices()[0]
    slug = "cpu" if dev.platform == "cpu" else dev.device_kind.replace(" ", "-").lower()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{slug}.md")
    with open(path, "w") as f:
        f.write(table + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
