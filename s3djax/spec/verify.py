"""Tree verification: one full-model forward over [root + nodes], greedy acceptance, and commit.

Node i sits at RoPE position length + depth(i) and in cache slot length + i; it attends to the
committed prefix (slots < length) and to its ancestors. Verification runs the full target with no
draft parameters, so the accepted output is exactly the target's greedy output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax import model
from s3djax.cache import PrefixTreeMask
from s3djax.config import ModelConfig
from s3djax.spec.tree import TreeSpec


def tree_mask(length, tree: TreeSpec) -> PrefixTreeMask:
    """The committed prefix, plus each node's ancestors (itself included) in the scratch slots."""
    anc = jnp.asarray(tree.ancestors)
    return PrefixTreeMask(length, jnp.broadcast_to(anc, (length.shape[0],) + anc.shape))


def greedy_accept(tokens, target, valid, tree: TreeSpec):
    """[B, N] bool: a node is accepted when its token is its parent's argmax and its parent is accepted."""
    parents, depths = jnp.asarray(tree.parents), jnp.asarray(tree.node_depths)
    match = (tokens == jnp.take(target, parents, axis=1)) & valid
    accepted = jnp.zeros(tokens.shape, bool).at[:, 0].set(True)
    for d in range(1, tree.depth + 1):
        accepted = accepted | ((depths == d) & match & jnp.take(accepted, parents, axis=1))
    return accepted


def verify(params, cache, length, last, nodes, valid, *, config: ModelConfig, tree: TreeSpec):
    """Returns (cache with the accepted path committed, accepted drafts a [B], emitted tokens [B, D+1]).

    emitted[:, :a+1] are the a accepted tokens followed by the bonus token (the target's argmax
    after the deepest accepted node); the rest is padding.
    """
    tokens = jnp.concatenate([last[:, None], nodes], axis=1)
    depths = jnp.asarray(tree.node_depths)
    positions = length[:, None] + depths[None]
    mask = tree_mask(length, tree)
    hidden, cache = model.forward(params, tokens, positions, cache, length, mask, config=config)
    target = jnp.argmax(model.logits(params, hidden), axis=-1).astype(jnp.int32)
    accepted = greedy_accept(tokens, target, jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], 1), tree)
    deepest = jnp.argmax(jnp.where(accepted, depths, -1), axis=1)  # one accepted node per depth, so unique
    path = jnp.asarray(tree.path_table)[deepest]                   # [B, D+1]
    return commit_path(cache, length, path, tree.num_nodes), depths[deepest], jnp.take_along_axis(target, path, 1)


def commit_path(cache, length, path, num_nodes: int):
    """Move the K/V of the accepted path (node indices [B, D+1], root first) to slots length .. length+D.

    Entries past the accepted depth repeat the deepest node: they land beyond the new length, where
    nothing reads them.
    """

    def move(buf, start, idx):
        slab = jax.lax.dynamic_slice_in_dim(buf, start, num_nodes, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(buf, slab[idx], start, axis=0)

    move = jax.vmap(move)
    return [{name: move(buf, length, path) for name, buf in layer.items()} for layer in cache]
