"""A draft that reads int8 copies of its weights, while verification keeps the target's own.

A draft only proposes tokens: the full model verifies every one of them, so the draft may read weights
that differ from the target's and the output stays exactly the target's. On a memory-bound device a draft
step costs the bytes it reads, and int8 reads a quarter of fp32's. A layer-skip draft (S3D, Self-Spec)
gets int8 copies of the sub-layers its plan runs, as "weights": {i: {"attn" and/or "mlp": layer i's
linears in int8}}, the rest of the layer (its norms) read from the target's own arrays; verification
rewrites every cache slot it wrote. S3D's and S2D's LoRA adapters are folded into those copies before they are
quantized (int8 of W + A B, `folded`) where every one sits on a float weight of its own: a step then runs no
adapter, where each was two products (docs/methods.md#int8-draft-weights). A draft vocabulary's "head" and a
Kangaroo adapter's own attention ("attn") go int8 too. Kangaroo's shared layers stay the target's: its verification
reuses the states its draft computed there. S2D's nested draft gets int8 copies of its base layers (the original model's), its adapters
folded in, in its own cache, which it recomputes itself; under a changed target the float base layers it
carries keep only their norms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax import defaults, quant
from s3djax.errors import UserError
from s3djax.model import layer_key, with_layers
from s3djax.skip_plan import SkipPlan

MODES = ("none", "int8")
def default_mode() -> str:
    return defaults.fallback("draft_weights")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise UserError(f"unknown draft weights {mode!r}; choose from {', '.join(MODES)}")


def attach(draft: dict, params: dict, mode: str | None, dtype, *, plan: SkipPlan | None = None,
           own: tuple[str, ...] = (), fold: bool = False) -> dict:
    """The draft with int8 copies of the weights it reads (`mode` "int8"; None: the platform's default), else
    unchanged: the sub-layers `plan` runs apart from verification, a draft vocabulary's head rows, and the
    draft's `own` subtrees of linears (a Kangaroo adapter's "attn"). `fold`: the draft's adapters go into the
    copies where they can (`folded`), and the draft keeps none."""
    mode = default_mode() if mode is None else mode
    check_mode(mode)
    if mode == "none":
        return draft
    # Under a W8A8 target the copies multiply in integers as the target does: weight-only int8 would be its slower path.
    int8 = "w8a8" if quant.mode_of(params) == "w8a8" else "int8"
    out = {**draft, **{name: quant.apply(draft[name], int8, dtype) for name in own}}
    if plan is not None:
        runs = {i: [part for part, on in (("attn", plan.attn[i]), ("mlp", plan.mlp[i])) if on]
                for i in range(plan.num_layers)}
        layers = {layer_key(i): {part: params[layer_key(i)][part] for part in parts}
                  for i, parts in runs.items() if parts}
        merged = folded(layers, draft.get("lora")) if fold else None
        if merged is not None:
            layers, out = merged, {k: v for k, v in out.items() if k != "lora"}
        layers = quant.apply(layers, int8, dtype)
        out["weights"] = {str(i): layers[layer_key(i)] for i, parts in runs.items() if parts}
        if "layers" in draft:  # S2D's own float layers (under a changed target): the copies replace their linears
            out["layers"] = [{k: v for k, v in layer.items() if k not in out["weights"].get(str(i), {})}
                             for i, layer in enumerate(draft["layers"])]
    if "head" in draft:
        out["head"] = quant.table(draft["head"], "w8a8" if int8 == "w8a8" else "int8-all", dtype)
    return out


def folded(layers: dict, lora: list | None) -> dict | None:
    """`layers` ({layer key: {sub-layer: {name: W}}}, the sub-layers a draft runs) with every adapter of `lora` (a
    per-layer list of {name: {"a", "b"}}) on them folded in as W + A B, in fp32 and back to W's dtype; None where
    there is no adapter or one cannot be folded: on a weight that is not a float array (an int8 target's own
    copies), or on a name the layer holds joined (a Llama's q under its q/k/v joined for a GPU; Phi-3's adapters sit on
    its qkv itself). An adapter on a sub-layer the draft skips is never read."""
    if not lora:
        return None
    out = {key: {part: dict(weights) for part, weights in parts.items()} for key, parts in layers.items()}
    for i, adapters in enumerate(lora):
        parts = out.get(layer_key(i), {})
        for name, ab in (adapters or {}).items():
            holder = [weights for weights in parts.values() if name in weights]
            if not holder and any(name in quant.JOINED.get(joined, ()) for weights in parts.values() for joined in weights):
                return None
            if not holder:
                continue  # a sub-layer (or a layer) the plan skips
            w = holder[0][name]
            if quant.is_weight(w) or not jnp.issubdtype(w.dtype, jnp.floating):
                return None
            holder[0][name] = (w.astype(jnp.float32) + ab["a"].astype(jnp.float32) @ ab["b"].astype(jnp.float32)
                               ).astype(w.dtype)
    return out


def of(params: dict, draft) -> dict:
    """The params a draft forward reads: the target's, with the draft's own copies in place of its layers."""
    return with_layers(params, draft["weights"]) if isinstance(draft, dict) and "weights" in draft else params


def own_leaves(params, draft) -> list:
    """The draft's arrays that are not the target's own: what it adds beside the target."""
    shared = {id(a) for a in jax.tree.leaves(params)}
    return [a for a in jax.tree.leaves(draft) if id(a) not in shared]


def about(draft, params) -> str:
    """Named only where the draft reads int8 weights of its own: an int8 target's copies are its own arrays."""
    return ", draft weights int8" if isinstance(draft, dict) and any(
        getattr(a, "dtype", None) == jnp.int8 for a in own_leaves(params, draft)) else ""
