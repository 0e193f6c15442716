"""The KV cache: a plain pytree of per-layer K and V buffers of fixed length.

Slots (where K/V live in the buffer) are kept apart from RoPE positions, because the tree verifier
writes nodes of equal depth, i.e. equal position, into different slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax.config import ModelConfig


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> list[dict]:
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(config.num_layers)]


def cache_len(cache) -> int:
    return cache[0]["k"].shape[1]


def write(layer_cache: dict, k, v, slots) -> dict:
    """Write new K/V [B, T, K, D] at each row's own starting slot (slots: [B])."""
    put = jax.vmap(lambda buf, new, s: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), s, axis=0))
    return {"k": put(layer_cache["k"], k, slots), "v": put(layer_cache["v"], v, slots)}


def causal_mask(slots, num_new: int, max_len: int):
    """[B, T, S]: new token t (at slot slots[b] + t) sees every slot up to and including its own."""
    own = slots[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(max_len)[None, None, :] <= own[:, :, None]
