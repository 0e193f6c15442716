"""Verification attention: T new queries over a committed cache prefix plus their own T keys under a tree mask.

One kernel serves the AR step (T = 1), the S3D draft block (T = gamma, a causal "tree") and tree
verification (T = nodes). The prefix length is a run-time value: it bounds the loop over key
blocks, so blocks past it are never read and a new length compiles nothing.

Layout (flash-decoding): the grid is (batch, KV head, split). A program takes every query row of
one KV head's group ([G*T, D], so each K/V block is loaded once per group), walks its share of
the prefix blocks with an online softmax, and writes an unnormalised partial (acc, max, sum).
Split 0 also takes the T new keys under the tree mask. `combine` merges the splits (one split: a
division, which XLA fuses into the next product).

Given the new tokens' slots, split 0 also writes their keys and values into the caches, which come back updated in
place (aliased): on a GPU each separate cache write was a kernel launch of its own, two a layer every step.

Triton wants every array a power of two, so query rows, new keys and the head dim are padded to
one (Phi-3's 96 to 128). The cache is not copied for it: its blocks overhang the real head dim, and the
kernel masks the loads past it, which, zero, add nothing to q.k or p@v. The queries and the new keys and
values are padded with zeros into one operand, by the one fusion that groups the query rows.
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


def _kernel(*refs, block_k: int, splits: int, head_dim: int, new_tokens: int, scale: float, write: bool):
    lengths_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, tree_ref = refs[:7]
    slots_ref, (o_ref, m_ref, l_ref), caches = (refs[7], refs[8:11], refs[11:]) if write else (None, refs[7:10], ())
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
    # The splits share the blocks below the run-time length, so each walks its part at any length.
    blocks = pl.cdiv(length, block_k)
    per_split = pl.cdiv(blocks, splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, blocks)
    carry = jax.lax.fori_loop(first, jnp.maximum(first, last), prefix_block, carry)
    # The new keys belong to split 0 alone; the other splits add nothing for them. Their padding is zeros, masked.
    own = tree_ref[...] & (split == 0)
    acc, m, l = attend(carry, kn_ref[...], vn_ref[...], own)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
    if write:
        _write_new_rows(slots_ref[b], s_len, new_tokens, columns, split, (kn_ref, vn_ref), caches)


def _write_new_rows(slot, s_len: int, new_tokens: int, columns, split, news, caches):
    """Split 0 copies the new keys and values into its KV head of the caches, row by row (a block of the T rows
    would be a power of two, past T), from `slot` moved back to fit as `dynamic_update_slice` moves it. The other
    splits read the caches below their length alone, and these rows lie at or past it."""
    start = jnp.minimum(slot, s_len - new_tokens)

    @pl.when(split == 0)
    def _():
        def row(i, carry):
            for new, cache in zip(news, caches):
                common.masked_store(cache.at[pl.ds(start + i, 1), :], new[pl.ds(i, 1), :], columns)
            return carry

        jax.lax.fori_loop(0, new_tokens, row, 0)


def combine(acc, m, l):
    """Merge per-split partials ([..., splits, R, D], [..., splits, R]) into normalised outputs [..., R, D]."""
    top = m.max(axis=-2, keepdims=True)
    w = jnp.exp(m - top)
    return (acc * w[..., None]).sum(axis=-3) / (l * w).sum(axis=-2)[..., None]


# The most of one KV head's cache (keys x head dim: 2,048 keys of 64) a program reads alone. A longer cache is split
# across programs, whose partials a second launch merges; on a GPU a small model's step is bound by its launches
# (docs/gpu-compile.md), and below this the merge is projected to cost about what the split saves (not yet measured:
# `benchmarks.gpu_steps`'s smollm2/split setting times it).
ALONE = 2048 * 64


def choose_blocks(cache_len: int, rows: int, head_dim: int = 64) -> tuple[int, int]:
    """(block_k, splits): 128-key blocks (or the whole buffer when shorter); one split up to `ALONE`, else enough
    that a single sequence gives every KV head several programs while each split still walks a few blocks."""
    block_k = min(128, 1 << (cache_len.bit_length() - 1))
    blocks = pl.cdiv(cache_len, block_k)
    if cache_len * head_dim <= ALONE:
        return block_k, 1
    splits = max(1, min(16, blocks // 4)) if rows <= 64 else max(1, min(4, blocks // 8))
    return block_k, splits


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "backend", "poison"))
def tree_attention(q, k_cache, v_cache, lengths, k_new, v_new, tree, slots=None, *, block_k: int | None = None,
                   splits: int | None = None, backend: str | None = None, poison: bool = False):
    """The Pallas kernel with `reference`'s signature. `slots` [B]: also write k_new and v_new into the caches from
    each row's slot (where `dynamic_update_slice` would), and return (out, k_cache, v_cache), the caches updated in
    place. backend: one of `common.BACKENDS`, or None for the one that fits the platform lowered for (see `common`).
    `poison` fills the attention's output buffers with NaN before the call (a test that every element gets
    written)."""
    b, t, h, d = q.shape
    s, kv_heads = k_cache.shape[1], k_cache.shape[2]
    g = h // kv_heads
    rows = g * t
    auto_block, auto_splits = choose_blocks(s, rows, d)
    block_k, splits = block_k or auto_block, splits or auto_splits
    # Rows are (group member, token), the same folding as s3djax.layers.attend. Rows, new keys and
    # the head dim take powers of two of at least 16, as Triton's dot needs: the queries and new keys padded, the
    # cache's head dim overhung; padded keys are masked out, rows and columns dropped.
    rows_p, t_p, d_p = _padded(rows), _padded(t), _padded(d)
    if k_new.dtype != q.dtype or v_new.dtype != q.dtype:
        raise ValueError(f"queries ({q.dtype}) and new keys and values ({k_new.dtype}, {v_new.dtype}) differ in dtype")
    # One operand [B, K, R + 2 T, D] holds each KV head's query rows, then its new keys, then its new values, zero
    # padded: made by one fusion (on a GPU, one launch where three pads and slices were).
    qr = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, rows, d)
    packed = jnp.concatenate([jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, d_p - d))) for x, n in
                              ((qr, rows_p), (k_new.transpose(0, 2, 1, 3), t_p), (v_new.transpose(0, 2, 1, 3), t_p))], axis=2)
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
        # The new keys and values: blocks of T rows of the packed operand, after the R query rows (R, a power of two
        # no smaller than T, is a whole number of them).
        pl.BlockSpec((sq, sq, t, d_p), lambda i, j, k: (i, j, rows // t, 0)),
        pl.BlockSpec((sq, sq, t, d_p), lambda i, j, k: (i, j, rows // t + 1, 0)),
        pl.BlockSpec((sq, rows, t), lambda i, j, k: (i, 0, 0)),
    ]
    out_specs = [pl.BlockSpec((sq, sq, sq, rows, d_p), lambda i, j, k: (i, j, k, 0, 0)),
                 pl.BlockSpec((sq, sq, sq, rows), lambda i, j, k: (i, j, k, 0)),
                 pl.BlockSpec((sq, sq, sq, rows), lambda i, j, k: (i, j, k, 0))]
    args = [lengths.astype(jnp.int32), packed, k_cache, v_cache, packed, packed, tree_rows]
    write = slots is not None
    aliases = {}
    if write:  # the caches, inputs 2 and 3, are outputs 3 and 4 as well
        args.append(slots.astype(jnp.int32))
        in_specs.append(in_specs[0])
        out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        out_specs += in_specs[2:4]
        aliases = {2: 3, 3: 4}
    inputs = len(args)
    if poison:
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape[:3]]
        in_specs += out_specs[:3]
        aliases.update({inputs + i: i for i in range(3)})
    kernel = functools.partial(_kernel, block_k=block_k, splits=splits, head_dim=d,
                               new_tokens=q.shape[1], scale=d ** -0.5, write=write)
    if poison:
        kernel = functools.partial(_drop_aliased_inputs, kernel, inputs)
    acc, m, l, *caches = common.pallas_call(kernel, backend, num_warps=4, num_stages=2, out_shape=out_shape,
                                            grid=(b, kv_heads, splits), in_specs=in_specs, out_specs=out_specs,
                                            input_output_aliases=aliases, name="tree_attention")(*args)
    out = combine(acc, m, l)[:, :, :g * q.shape[1], :d]                               # [B, K, G*T, D]
    t = q.shape[1]
    out = out.reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return (out, *caches) if write else out


def _padded(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _drop_aliased_inputs(kernel, inputs: int, *refs):
    # The poisoned output buffers also arrive as inputs, after the real ones; the kernel only writes them.
    return kernel(*refs[:inputs], *refs[inputs + 3:])
