"""A draft that reads int8 copies of the layers it runs, while verification keeps the target's own weights.

A layer-skip draft (S3D, Self-Spec) only proposes tokens: the full model verifies every one of them and
rewrites every cache slot the draft wrote, so the draft may read weights that differ from the target's and
the output stays exactly the target's. On a memory-bound device a draft step costs the bytes it reads, and
int8 reads a quarter of fp32's. The draft params then carry "weights": {layers_i: the layer in int8} for the
layers the plan runs, and a draft vocabulary's "head" in int8 too.

Kangaroo and S2D cannot: their verification reuses the states their draft computed in the shared layers.
"""

from __future__ import annotations

import jax

from s3djax import quant
from s3djax.errors import UserError
from s3djax.model import layer_key
from s3djax.skip_plan import SkipPlan

MODES = ("none", "int8")
# Measured fastest on the 2-core Zen 3 with the CPU matmul kernel
# (benchmarks/results/draft-weights-cpu-2026-11-26.md). No GPU has measured it: the target's own weights.
FASTEST = {"cpu": "int8"}


def default_mode() -> str:
    return FASTEST.get(jax.default_backend(), "none")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise UserError(f"unknown draft weights {mode!r}; choose from {', '.join(MODES)}")


def attach(draft: dict, params: dict, plan: SkipPlan, mode: str, dtype) -> dict:
    """The draft with int8 copies of the weights it reads (`mode` "int8"), else unchanged."""
    check_mode(mode)
    if mode == "none":
        return draft
    kept = [i for i in range(plan.num_layers) if plan.attn[i] or plan.mlp[i]]
    layers = quant.apply({layer_key(i): params[layer_key(i)] for i in kept}, "int8", dtype)
    out = {**draft, "weights": layers}
    if "head" in draft:
        out["head"] = quant.table(draft["head"], "int8-all", dtype)
    return out


def of(params: dict, draft) -> dict:
    """The params a draft forward reads: the target's, with the draft's own copies in place of its layers."""
    return {**params, **draft["weights"]} if isinstance(draft, dict) and "weights" in draft else params


def about(draft) -> str:
    return ", draft weights int8" if isinstance(draft, dict) and "weights" in draft else ""
