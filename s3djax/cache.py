"""The KV cache: a plain pytree of per-layer K and V buffers of fixed length.

Slots (where K/V live in the buffer) are kept apart from RoPE positions, because the tree verifier
writes nodes of equal depth, i.e. equal position, into different slots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from s3djax.config import ModelConfig


# A bfloat16 cache that decoding on the CPU holds as its bits: XLA:CPU widens a bfloat16 dynamic-update-slice to fp32
# and back, which copies the whole cache twice a layer every step. Bits are written in place. Training keeps bfloat16
# (no gradient flows through a bitcast to integers).
BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
FLOATS = {v: k for k, v in BITS.items()}


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, bits: bool = False) -> list[dict]:
    """Zeroed K/V [B, S, KV, D] per layer of `dtype`, held as `BITS` where `bits` asks and the dtype has them."""
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(dtype)
    held = BITS.get(dtype, dtype) if bits else dtype
    return [{"k": jnp.zeros(shape, held), "v": jnp.zeros(shape, held)} for _ in range(config.num_layers)]


def float_dtype(x):
    """The float dtype of a cache array, held as bits or not."""
    return FLOATS.get(x.dtype, x.dtype)


def layout(cache) -> dict:
    """`init_cache`'s dtype and bits for another cache held as `cache` is (a drafter's own beside the target's)."""
    return dict(dtype=float_dtype(cache[0]["k"]), bits=cache[0]["k"].dtype in FLOATS)


def floats(x):
    """A cache array as floats (XLA materializes the bitcast of a whole cache: the CPU kernel reads the bits)."""
    return jax.lax.bitcast_convert_type(x, FLOATS[x.dtype]) if x.dtype in FLOATS else x


def cache_len(cache) -> int:
    return cache[0]["k"].shape[1]


@jax.jit  # traced once per shape, not once per layer (as `quant.dot`)
def put_rows(buf, new, starts):
    """Write new [B, T, ...] into buf [B, S, ...] from each row's own start (starts: [B]), in buf's dtype."""
    held = float_dtype(buf)
    new = new.astype(held) if held == buf.dtype else jax.lax.bitcast_convert_type(new.astype(held), buf.dtype)
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0))(buf, new, starts)


def write(layer_cache: dict, k, v, slots) -> dict:
    """Write new K/V [B, T, K, D] at each row's own starting slot (slots: [B])."""
    return {"k": put_rows(layer_cache["k"], k, slots), "v": put_rows(layer_cache["v"], v, slots)}


class PrefixTreeMask(NamedTuple):
    """The mask of every decode-time step: each of T new tokens sees every slot below lengths[b] plus
    the scratch slots lengths[b] + j its row of `tree` allows.

    Square trees (the T new tokens are the scratch slots) go to the Pallas kernel as they are (a
    run-time length, a T x T mask). A W-wide tree serves an autoregressive drafter's block, whose
    tokens sit somewhere inside a W-slot scratch tree; XLA attention expands either.
    """
    lengths: jax.Array  # [B] int32
    tree: jax.Array     # [B, T, W] bool

    def dense(self, max_len: int):
        """[B, T, S] bool over the cache slots."""
        return self.over(jnp.arange(max_len))

    def over(self, slots):
        """[B, T, N] bool over the given cache slots [N]."""
        b, t, w = self.tree.shape
        rel = slots[None, :] - self.lengths[:, None]                                 # [B, N]
        cols = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], (b, t, slots.shape[0]))
        new = jnp.take_along_axis(self.tree, cols, axis=2) & ((rel >= 0) & (rel < w))[:, None, :]
        return (rel < 0)[:, None, :] | new

    @property
    def extent(self):
        """Slots any row may read: every mask is False from here on."""
        return jnp.max(self.lengths) + self.tree.shape[2]


def causal(slots, num_new: int) -> PrefixTreeMask:
    """New token t (at slot slots[b] + t) sees every slot up to and including its own."""
    tri = jnp.tril(jnp.ones((num_new, num_new), bool))
    return PrefixTreeMask(slots, jnp.broadcast_to(tri, (slots.shape[0], num_new, num_new)))


def causal_mask(slots, num_new: int, max_len: int):
    """`causal` as a dense [B, T, S] mask."""
    return causal(slots, num_new).dense(max_len)


class PromptMask(PrefixTreeMask):
    """`causal` for a chunk of prompt (a prefill): hundreds of rows, which attention reads in XLA's key blocks up
    to the occupied prefix; the decode-time kernels are shaped for a step's few rows."""


def prompt_chunk(slots, num_new: int) -> PromptMask:
    return PromptMask(*causal(slots, num_new))
