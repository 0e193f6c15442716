"""Verification attention: T new queries over a committed cache prefix plus their own T keys under a tree mask.

One kernel serves the AR step (T = 1), the S3D draft block (T = gamma, a causal "tree") and tree
verification (T = nodes). The prefix length is a run-time value: it bounds the loop over key
blocks, so blocks past it are never read and a new length compiles nothing.

Layout (flash-decoding): the grid is (batch, KV head, split). A program takes every query row of
one KV head's group ([G*T, D], so each K/V block is loaded once per group), walks its share of
the prefix blocks with an online softmax, and writes an unnormalised partial (acc, max, sum).
Split 0 also takes the T new keys under the tree mask. `combine` merges the splits.

Triton wants every array a power of two, so query rows, new keys and the head dim are padded to
one (Phi-3's 96 to 128). Neither the cache nor the new keys are copied for it: their blocks overhang
the real head dim (and the new keys' block the real T), and the kernel masks the loads past them, which,
zero, add nothing to q.k or p@v. Only the queries are padded, in the fusion that groups their rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import common

NEG = -1e30  # a finite "minus infinity": exp(NEG - m) underflows to 0 without inf - inf = nan


def reference(q, k_cache, v_cache, lengths, k_new, v_new, tree):
    """Plain jnp: q [B, T, H, D]; caches [B, S, K, D]; lengths [B]; new K/V [B, T, K, D]; tree [B, T, T] bool.

    Query t sees cache slots < lengths[b] and new key u where tree[b, t, u]. Returns [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    g = h // k_cache.shape[2]
    k = jnp.concatenate([k_cache, k_new], axis=1)
    v = jnp.concatenate([v_cache, v_new], axis=1)
    s = k_cache.shape[1]
    prefix = jnp.arange(s)[None, None, :] < lengths[:, None, None]
    mask = jnp.concatenate([jnp.broadcast_to(prefix, (b, t, s)), tree], axis=2)          # [B, T, S+T]
    kk = jnp.repeat(k, g, axis=2).astype(jnp.float32)
    vv = jnp.repeat(v, g, axis=2).astype(jnp.float32)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kk) * d ** -0.5
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), vv).astype(q.dtype)


def _kernel(lengths_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, tree_ref, o_ref, m_ref, l_ref, *,
            block_k: int, blocks_per_split: int, head_dim: int, new_tokens: int, scale: float):
    b, split = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    s_len = k_ref.shape[0]
    q = q_ref[...].astype(jnp.float32) * scale                                    # [R, D]
    rows, d_p = q.shape
    columns = None if head_dim == d_p else jax.lax.broadcasted_iota(jnp.int32, (1, d_p), 1) < head_dim

    def attend(carry, k, v, visible):
        acc, m, l = carry
        scores = jnp.where(visible, jax.lax.dot_general(q, k.astype(jnp.float32), (((1,), (1,)), ((), ()))), NEG)
        m_new = jnp.maximum(m, scores.max(axis=1))
        p = jnp.where(visible, jnp.exp(scores - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        return acc * correction[:, None] + p @ v.astype(jnp.float32), m_new, l * correction + p.sum(axis=1)

    def prefix_block(j, carry):
        # A block that would run past the buffer is moved back to end at it; the positions already
        # covered by the previous block are masked out, so nothing is read out of bounds or twice.
        start = jnp.minimum(j * block_k, s_len - block_k)
        pos = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = (pos >= j * block_k) & (pos < length)
        span = pl.ds(start, block_k)
        return attend(carry, common.masked_load(k_ref.at[span, :], columns),
                      common.masked_load(v_ref.at[span, :], columns), jnp.broadcast_to(visible, (rows, block_k)))

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_k))
    carry = jax.lax.fori_loop(first, jnp.maximum(first, last), prefix_block, carry)
    # The new keys belong to split 0 alone; the other splits add nothing for them.
    own = tree_ref[...] & (split == 0)
    t_p = kn_ref.shape[0]
    new = columns if new_tokens == t_p else (jax.lax.broadcasted_iota(jnp.int32, (t_p, 1), 0) < new_tokens) & (
        True if columns is None else columns)
    acc, m, l = attend(carry, common.masked_load(kn_ref, new), common.masked_load(vn_ref, new), own)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def combine(acc, m, l):
    """Merge per-split partials ([..., splits, R, D], [..., splits, R]) into normalised outputs [..., R, D]."""
    top = m.max(axis=-2, keepdims=True)
    w = jnp.exp(m - top)
    return (acc * w[..., None]).sum(axis=-3) / (l * w).sum(axis=-2)[..., None]


def choose_blocks(cache_len: int, rows: int) -> tuple[int, int]:
    """(block_k, splits): 128-key blocks (or the whole buffer when shorter), and enough splits that a
    single sequence gives every KV head several programs while each split still walks a few blocks."""
    block_k = min(128, 1 << (cache_len.bit_length() - 1))
    blocks = pl.cdiv(cache_len, block_k)
    splits = max(1, min(16, blocks // 4)) if rows <= 64 else max(1, min(4, blocks // 8))
    return block_k, splits


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "backend", "poison"))
def tree_attention(q, k_cache, v_cache, lengths, k_new, v_new, tree, *, block_k: int | None = None,
                   splits: int | None = None, backend: str | None = None, poison: bool = False):
    """The Pallas kernel with `reference`'s signature. backend: one of `common.BACKENDS`, or None for
    the one that fits the platform lowered for (see `common`). `poison` fills the output buffers with
    NaN before the call (a test that every element gets written)."""
    b, t, h, d = q.shape
    s, kv_heads = k_cache.shape[1], k_cache.shape[2]
    g = h // kv_heads
    rows = g * t
    auto_block, auto_splits = choose_blocks(s, rows)
    block_k, splits = block_k or auto_block, splits or auto_splits
    blocks_per_split = pl.cdiv(pl.cdiv(s, block_k), splits)
    # Rows are (group member, token), the same folding as s3djax.layers.attend. Rows, new keys and
    # the head dim take powers of two of at least 16, as Triton's dot needs: the query rows padded, the
    # new keys' and the head dim's blocks overhanging; padded keys are masked out, rows and columns dropped.
    rows_p, t_p, d_p = _padded(rows), _padded(t), _padded(d)
    qr = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_p - rows), (0, d_p - d)))
    tree_rows = jnp.pad(jnp.tile(tree, (1, g, 1)), ((0, 0), (0, rows_p - rows), (0, t_p - t)))  # [B, R, T]
    rows, t = rows_p, t_p
    out_shape = [jax.ShapeDtypeStruct((b, kv_heads, splits, rows, d_p), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, splits, rows), jnp.float32)]
    sq = pl.Squeezed()
    in_specs = [
        pl.BlockSpec((b,), lambda i, j, k: (0,)),
        pl.BlockSpec((sq, sq, rows, d_p), lambda i, j, k: (i, j, 0, 0)),
        # The cache is read in place ([B, S, K, D], one KV head's [S, D] slice): no copy per call.
        # A head dim that is no power of two is overhung, and the kernel masks the columns past it.
        pl.BlockSpec((sq, s, sq, d_p), lambda i, j, k: (i, 0, j, 0)),
        pl.BlockSpec((sq, s, sq, d_p), lambda i, j, k: (i, 0, j, 0)),
        # The new keys too ([B, T, K, D], one KV head's [T, D]), their block overhanging T as well.
        pl.BlockSpec((sq, t, sq, d_p), lambda i, j, k: (i, 0, j, 0)),
        pl.BlockSpec((sq, t, sq, d_p), lambda i, j, k: (i, 0, j, 0)),
        pl.BlockSpec((sq, rows, t), lambda i, j, k: (i, 0, 0)),
    ]
    out_specs = [pl.BlockSpec((sq, sq, sq, rows, d_p), lambda i, j, k: (i, j, k, 0, 0)),
                 pl.BlockSpec((sq, sq, sq, rows), lambda i, j, k: (i, j, k, 0)),
                 pl.BlockSpec((sq, sq, sq, rows), lambda i, j, k: (i, j, k, 0))]
    args = [lengths.astype(jnp.int32), qr, k_cache, v_cache, k_new, v_new, tree_rows]
    aliases = {}
    if poison:
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
        in_specs += out_specs
        aliases = {len(args) - 3 + i: i for i in range(3)}
    kernel = functools.partial(_kernel, block_k=block_k, blocks_per_split=blocks_per_split, head_dim=d,
                               new_tokens=q.shape[1], scale=d ** -0.5)
    if poison:
        kernel = functools.partial(_drop_aliased_inputs, kernel)
    acc, m, l = common.pallas_call(kernel, backend, num_warps=4, num_stages=2, out_shape=out_shape,
                                   grid=(b, kv_heads, splits), in_specs=in_specs, out_specs=out_specs,
                                   input_output_aliases=aliases, name="tree_attention")(*args)
    out = combine(acc, m, l)[:, :, :g * q.shape[1], :d]                               # [B, K, G*T, D]
    t = q.shape[1]
    return out.reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def _padded(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _drop_aliased_inputs(kernel, *refs):
    # Aliased output buffers also arrive as inputs; the kernel only writes them.
    return kernel(*refs[:7], *refs[-3:])
