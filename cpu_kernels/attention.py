"""Decode-time attention on the CPU (`attention.inc`, through `ffi.cc`), beside its jnp reference.

Every decode, draft and verify step attends T new query rows over the KV cache under a prefix-and-tree
mask: row t of batch b sees the committed slots below lengths[b] and the scratch slots lengths[b] + j its
tree row allows. XLA:CPU runs that as dozens of small ops per layer, which cost more than the layer's
matmuls; one native call reads only the visible keys. Each row sums over its visible keys alone, in slot
order, so a verify row equals the same row decoded alone. Registered with the matmul (`matmul.usable`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import batching
from cpu_kernels.matmul import ATTENTION_TARGET

DTYPES = (jnp.float32, jnp.bfloat16)
MAX_HEAD = 128  # head sizes up to 16 vectors of AVX2 (the handler refuses wider ones)


def visible(lengths, tree, slots: int):
    """[B, T, S] bool: which cache slots each new row sees."""
    w = tree.shape[2]
    rel = jnp.arange(slots)[None, :] - lengths[:, None]
    cols = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], tree.shape[:2] + (slots,))
    scratch = jnp.take_along_axis(tree, cols, axis=2) & ((rel >= 0) & (rel < w))[:, None, :]
    return (rel < 0)[:, None, :] | scratch


def reference(q, k, v, lengths, tree, scale: float):
    """q [B, T, H, D] over k, v [B, S, KV, D] under the mask: [B, T, H, D] in q's dtype, in fp32 inside."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32) * scale, k, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(visible(lengths, tree, k.shape[1])[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v, precision=jax.lax.Precision.HIGHEST).astype(q.dtype)


def attention(q, k, v, lengths, tree, scale: float):
    """`reference` through the native kernel (the CPU only; register it first with `matmul.usable`)."""
    if q.dtype not in DTYPES or k.dtype not in (*DTYPES, jnp.uint16) or v.dtype != k.dtype or q.ndim != 4 \
            or k.shape != v.shape or k.ndim != 4 or q.shape[2] % k.shape[2] or tree.shape[:2] != q.shape[:2]:
        raise ValueError(f"CPU attention takes q [B, T, H, D] and k, v [B, S, KV, D] (k and v of one float dtype, or "
                         f"uint16 holding bfloat16 bits; q of one float dtype) with KV dividing H, and tree [B, T, W]; "
                         f"got {q.dtype.name} {q.shape}, {k.dtype.name} {k.shape}, {v.dtype.name} {v.shape}, "
                         f"tree {tree.shape}")
    def call(q, k, v, lengths, tree):
        return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
            q, k, v, lengths, tree, scale=np.float32(scale))
    return batching.folded(call, (True,) * 5)(q, k, v, lengths.astype(jnp.int32), tree.astype(bool))
