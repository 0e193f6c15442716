"""Draft-only parameters: the mask token <M> and optional LoRA adapters on the kept layers.

<M> is an extra embedding row kept outside the vocabulary ("extra-row"): the target's embedding
and LM head are untouched, so verification always uses the unmodified target. Adapters only ever
see block tokens, because the draft forward only processes blocks (the context comes from the
target's committed cache).

Draft files (and every drafter's trained artifact) are a .npz of the pytree's leaves plus a JSON
record of its metadata and shape.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from s3djax import quant
from s3djax.model import layers_of
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.skip_plan import SkipPlan

MASK_TOKEN_KIND = "extra-row"


def adapter_targets(config: ModelConfig) -> tuple[str, ...]:
    return ("qkv", "o", "gate_up", "down") if config.arch == "phi3" else ("q", "k", "v", "o", "gate", "up", "down")


def init_draft(params, config: ModelConfig, plan: SkipPlan, *, lora_rank: int = 0, key=None) -> dict:
    """<M> as the mean token embedding (a neutral start); adapters with B = 0, so they start as no-ops.

    Adapters go only on sub-layers the plan runs: the others never see a block token.
    """
    table = quant.dequantize(params["embed"])
    draft = {"mask_embed": jnp.mean(table.astype(jnp.float32), axis=0).astype(table.dtype)}
    if lora_rank:
        key = jax.random.key(0) if key is None else key
        lora = []
        for i, layer in enumerate(layers_of(params)):
            adapters = {}
            for name in adapter_targets(config):
                part = "attn" if name in layer["attn"] else "mlp"
                if plan.attn[i] if part == "attn" else plan.mlp[i]:
                    key, sub = jax.random.split(key)
                    w = layer[part][name]
                    d_in, d_out = w.shape
                    adapters[name] = {"a": (jax.random.normal(sub, (d_in, lora_rank)) / np.sqrt(d_in)).astype(
                        w.dtype), "b": jnp.zeros((lora_rank, d_out), w.dtype)}
            lora.append(adapters)
        draft["lora"] = lora
    return draft


def save_draft(path: str, draft: dict, meta: dict) -> None:
    """An S3D draft: an artifact whose metadata names its mask-token kind."""
    save_artifact(path, draft, {"mask_token": MASK_TOKEN_KIND, **meta})


def save_artifact(path: str, tree, meta: dict) -> None:
    """Any drafter's trained parameters as one .npz: the leaves (float32) and a JSON record of the
    metadata and of the pytree's shape, each leaf replaced by its index (empty layers survive)."""
    leaves, treedef = jax.tree.flatten(tree)
    structure = jax.tree.unflatten(treedef, list(range(len(leaves))))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, __meta__=np.frombuffer(json.dumps({**meta, "structure": structure}).encode(), np.uint8),
             **{f"leaf_{i}": np.asarray(jnp.asarray(leaf, jnp.float32)) for i, leaf in enumerate(leaves)})


def load_artifact(path: str, dtype, kind: str = "draft") -> tuple[dict, dict]:
    """(pytree with leaves in dtype, metadata) of a `save_artifact` file, or a one-line error."""
    if not os.path.isfile(path):
        raise UserError(f"no such {kind} file: {path}")
    try:
        with np.load(path) as f:
            meta = json.loads(bytes(f["__meta__"]).decode())
            structure = meta.pop("structure")
            tree = jax.tree.map(lambda i: jnp.asarray(f[f"leaf_{i}"], dtype), structure)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path} is not an s3djax {kind} file ({e})") from None
    return tree, meta


def nest_layer(layer: dict) -> dict:
    """A full-mode draft's layer as the Flax tree holds it; files written before the Flax modules hold
    flat {weight name: array} layers and are nested on load."""
    out = {}
    for name, w in layer.items():
        if isinstance(w, dict):
            out[name] = {**out.get(name, {}), **w}
        elif name.endswith("_norm"):
            out[name] = {"scale": w}
        else:
            out.setdefault("attn" if name in ("q", "k", "v", "o", "qkv") else "mlp", {})[name] = w
    return out


def load_draft(path: str, config: ModelConfig, dtype) -> tuple[dict, dict]:
    draft, meta = load_artifact(path, dtype)
    if "layers" in draft:
        draft["layers"] = {i: nest_layer(layer) for i, layer in draft["layers"].items()}
    if meta.get("mask_token") != MASK_TOKEN_KIND:
        raise UserError(f"{path}: unsupported mask token kind {meta.get('mask_token')!r}")
    if draft["mask_embed"].shape != (config.hidden_size,):
        raise UserError(f"{path} was trained for hidden size {draft['mask_embed'].shape[0]}, "
                        f"not this model's {config.hidden_size}")
    return draft, meta
