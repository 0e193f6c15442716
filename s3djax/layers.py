"""The pieces of a decoder layer, as pure functions over arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax.cache import PrefixTreeMask

# A large finite negative instead of -inf: a fully masked row (padding) then gives a uniform
# softmax instead of NaNs that would poison the cache through later layers.
MASKED = -1e30


def rms_norm(x, weight, eps):
    # As Hugging Face: normalise in fp32, cast back, then scale.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_tables(positions, inv_freq):
    """cos/sin of shape [B, T, 1, rotary_dim] (broadcast over heads), in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Hugging Face's rotate-half RoPE on the first rotary_dim features; the rest pass through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = (rot * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def attend(q, k, v, mask, new=None, impl: str = "xla"):
    """Grouped-query attention of new queries over the whole cache buffer.

    q: [B, T, H, D]; k, v: [B, S, K, D]; mask: [B, T, S] bool (True: may attend), or a
    `PrefixTreeMask`, which `impl="pallas"` hands to the tree-attention kernel together with the
    new tokens' own K/V `new` = (k, v) [B, T, K, D]. Returns [B, T, H*D].
    A KV head's query group is folded into the rows of one matmul ([G*T, D] x [D, S]), which XLA
    runs faster than a batched matmul over a separate group axis.
    """
    b, t, h, d = q.shape
    if isinstance(mask, PrefixTreeMask):
        if impl == "pallas" and mask.tree.shape[1] == mask.tree.shape[2]:
            from pallas_kernels.tree_attention import tree_attention

            return tree_attention(q, k, v, mask.lengths, *new, mask.tree).reshape(b, t, h * d)
        mask = mask.dense(k.shape[1])
    kv_heads = k.shape[2]
    g = h // kv_heads
    q = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
    scores = jnp.einsum("bkqd,bskd->bkqs", q, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(jnp.tile(mask, (1, g, 1))[:, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v)
    return out.reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)


def swiglu(gate, up):
    return jax.nn.silu(gate) * up
