"""Which parameters each training mode trains, kept apart from the frozen rest.

The optimizer only ever sees the trainable tree, so "gradients reach only what the mode allows"
holds by construction; `assemble` puts the two trees back together for the forward pass.
- lossless: {"mask_embed", "lora"}: draft-only; the target is untouched.
- full: {"mask_embed", "layers": {"i": {sub-module: {weight: array}}}} over the sub-layers the draft
  runs; the trained layers replace the target's, and the skipped ones stay frozen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.model import layers_of, with_layers
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.draft_params import init_draft, load_artifact

_ATTN = ("attn_norm", "attn")
_MLP = ("mlp_norm", "mlp")


def init_trainable(params, config: ModelConfig, plan: SkipPlan, mode: str, lora_rank: int, key) -> dict:
    if mode == "lossless":
        return init_draft(params, config, plan, lora_rank=lora_rank, key=key)
    layers = {}
    for i, layer in enumerate(layers_of(params)):
        names = (_ATTN if plan.attn[i] else ()) + (_MLP if plan.mlp[i] else ())
        if names:
            layers[str(i)] = {n: w for n, w in layer.items() if n in names}
    return {"mask_embed": init_draft(params, config, plan)["mask_embed"], "layers": layers}


def assemble(trainable: dict, frozen: dict) -> tuple[dict, dict]:
    """(model params, draft params) for the forward pass."""
    if "layers" not in trainable:
        return frozen, trainable
    return with_layers(frozen, trainable["layers"]), {"mask_embed": trainable["mask_embed"]}


def warm_start(fresh: dict, path: str | None, what: str, load=None) -> dict:
    """`fresh` (the trainable tree a task starts from), or the same tree read from a draft file (init_from).

    Entries the file holds beyond the trainable ones are left out, and entries it lacks keep their fresh
    start (a correction added to a trained draft). A lower-rank adapter or correction grows: its arrays
    fill the leading rows and columns of the fresh ones, whose output side starts at 0, so the draft
    starts exactly as the file's. Any other difference in structure or shape is one line of error.
    `load(path)` reads the file (default `load_artifact` in float32).
    """
    if not path:
        return fresh
    start, _ = load(path) if load else load_artifact(path, jnp.float32)
    start = {k: start.get(k, v) for k, v in fresh.items()}
    if jax.tree.structure(start) != jax.tree.structure(fresh) or not all(
            np.ndim(a) == np.ndim(b) and all(i <= j for i, j in zip(np.shape(a), np.shape(b)))
            for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(fresh))) or \
            not all(_grows_exactly(k, start[k], fresh[k]) for k in fresh):
        raise UserError(f"init_from {path} is not {what}")
    return jax.tree.map(lambda a, b: jnp.asarray(b).at[tuple(slice(0, n) for n in np.shape(a))].set(a), start, fresh)


def _grows_exactly(name: str, start, fresh) -> bool:
    """Only adapters and corrections may grow, and only where the fresh arrays' extra rows are 0 (their rank
    dimension on the output side), so that the grown draft computes what the file's did."""
    if jax.tree.map(np.shape, start) == jax.tree.map(np.shape, fresh):
        return True
    return name in ("lora", "correction") and all(
        not np.any(np.asarray(b)[np.shape(a)[0]:])
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(fresh)) if np.shape(a)[0] < np.shape(b)[0])
