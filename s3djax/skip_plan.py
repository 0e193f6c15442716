"""Which sub-layers a forward pass runs: a static, hashable plan, so skipped work is compiled out.

Spec strings (CLI and YAML) list what to *skip*: comma-separated layer numbers or ranges, each
optionally suffixed `.attn` or `.mlp` to skip only that sub-layer, e.g. "8-21" or "3.attn,5-7.mlp".
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from s3djax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SkipPlan:
    attn: tuple[bool, ...]  # True: the layer's attention sub-layer runs
    mlp: tuple[bool, ...]   # True: the layer's MLP sub-layer runs

    def __post_init__(self):
        if len(self.attn) != len(self.mlp):
            raise UserError(f"invalid skip plan: {len(self.attn)} attention flags but {len(self.mlp)} MLP flags")
        if not any(self.attn) and not any(self.mlp):
            raise UserError("invalid skip plan: it skips every sub-layer, so nothing is left to run")

    @property
    def num_layers(self) -> int:
        return len(self.attn)

    @property
    def is_full(self) -> bool:
        return all(self.attn) and all(self.mlp)

    def check(self, num_layers: int) -> "SkipPlan":
        if self.num_layers != num_layers:
            raise UserError(f"invalid skip plan: it has {self.num_layers} layers but the model has {num_layers}")
        return self

    @classmethod
    def full(cls, num_layers: int) -> "SkipPlan":
        return cls((True,) * num_layers, (True,) * num_layers)

    @classmethod
    def skipping_layers(cls, num_layers: int, layers) -> "SkipPlan":
        skip = set(layers)
        keep = tuple(i not in skip for i in range(num_layers))
        return cls(keep, keep)

    @classmethod
    def symmetric_middle(cls, num_layers: int, num_skipped: int) -> "SkipPlan":
        """S3D's default: skip `num_skipped` whole layers centred on the middle of the stack."""
        if not 0 <= num_skipped < num_layers:
            raise UserError(f"invalid skip plan: cannot skip {num_skipped} of {num_layers} layers")
        start = (num_layers - num_skipped) // 2
        return cls.skipping_layers(num_layers, range(start, start + num_skipped))

    @classmethod
    def parse(cls, spec: str, num_layers: int) -> "SkipPlan":
        attn, mlp = [True] * num_layers, [True] * num_layers
        for item in filter(None, (s.strip() for s in spec.split(","))):
            layers, _, part = item.partition(".")
            if part not in ("", "attn", "mlp"):
                raise UserError(f"invalid skip plan {spec!r}: {item!r} must end in .attn or .mlp, or in neither")
            lo, _, hi = layers.partition("-")
            try:
                lo, hi = int(lo), int(hi or lo)
            except ValueError:
                raise UserError(f"invalid skip plan {spec!r}: {layers!r} is not a layer number or range") from None
            if not 0 <= lo <= hi < num_layers:
                raise UserError(f"invalid skip plan {spec!r}: layers {lo}-{hi} are outside 0-{num_layers - 1}")
            for i in range(lo, hi + 1):
                if part in ("", "attn"):
                    attn[i] = False
                if part in ("", "mlp"):
                    mlp[i] = False
        return cls(tuple(attn), tuple(mlp))

    def spec(self) -> str:
        """The inverse of `parse`, with runs of layers skipped alike written as ranges ("8-21")."""
        kinds = ["" if not a and not m else ".attn" if not a else ".mlp" if not m else None
                 for a, m in zip(self.attn, self.mlp)]
        items, i = [], 0
        while i < len(kinds):
            j = i
            while j + 1 < len(kinds) and kinds[j + 1] == kinds[i]:
                j += 1
            if kinds[i] is not None:
                items.append((f"{i}" if i == j else f"{i}-{j}") + kinds[i])
            i = j + 1
        return ",".join(items)


class DynamicPlan(NamedTuple):
    """A plan as traced flags ([L] bool each): every candidate of a search runs in one executable."""
    attn: jax.Array
    mlp: jax.Array

    @classmethod
    def of(cls, plan: SkipPlan) -> "DynamicPlan":
        return cls(np.asarray(plan.attn, bool), np.asarray(plan.mlp, bool))
