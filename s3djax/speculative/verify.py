"""Tree verification: one full-model forward over [root + nodes], acceptance, and commit.

Node i sits at RoPE position length + depth(i) and in cache slot length + i; it attends to the
committed prefix (slots < length) and to its ancestors. Verification runs the full target with no
draft parameters. Greedy acceptance keeps exactly the target's greedy output; sampled acceptance
(recursive rejection sampling) keeps exactly the target's sampling distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax.cache import PrefixTreeMask
from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.sampling import Sampling, draw_from_probs, process_logits
from s3djax.speculative.tree import TreeArrays


def tree_mask(length, tree: TreeArrays) -> PrefixTreeMask:
    """The committed prefix, plus each node's ancestors (itself included) in the scratch slots."""
    return PrefixTreeMask(length, tree.ancestors)


def greedy_accept(tokens, target, valid, tree: TreeArrays):
    """[B, N] bool: a node is accepted when its token is its parent's argmax and its parent is accepted."""
    parents, depths = tree.parents, tree.depths
    match = (tokens == jnp.take_along_axis(target, parents, axis=1)) & valid
    accepted = jnp.zeros(tokens.shape, bool).at[:, 0].set(True)
    for d in range(1, tree.depth + 1):
        accepted = accepted | ((depths == d) & match & jnp.take_along_axis(accepted, parents, axis=1))
    return accepted


def _normalized(p):
    return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)


def accept_probability(r_tok, q_tok):
    """min(1, r(x) / q(x)) for a candidate x drawn from q (so q(x) > 0)."""
    return jnp.minimum(1.0, r_tok / jnp.maximum(q_tok, 1e-30))


def sample_accept(tokens, probs, child_probs, valid, key, tree: TreeArrays):
    """Recursive rejection sampling down a tree: (deepest accepted node [B], final token [B]).

    tokens [B, N] (root first); probs [B, N, V]: the target's distribution after each node;
    child_probs [B, N, V]: the draft distribution each node's children were drawn from, in rank
    order and without replacement; valid [B, N].

    At a node, with residual r = p(node) and proposal q: the child of rank i is accepted with
    probability min(1, r(x)/q(x)); on rejection r <- norm(max(r - q, 0)) and x leaves q (the next
    candidate was drawn from q without x). Each step is the one-candidate speculative-sampling lemma
    (Leviathan et al. 2023, Thm. 1) applied to the candidate's own conditional proposal, so by
    induction over the candidates the token leaving the node is distributed as p(node) whatever was
    drafted: SpecInfer's multi-step speculative sampling (Miao et al. 2024, Thm. 4.2) with the
    without-replacement correction of recursive speculative decoding (Jeon et al. 2024, Sec. 3.1).
    The final token is drawn from the residual where every child was rejected, or from p at the
    deepest node (the bonus token).
    """
    b = tokens.shape[0]
    rows = jnp.arange(b)
    children = tree.children
    width = children.shape[2]
    keys = jax.random.split(key, tree.depth * width + 1)
    cur, going, r = jnp.zeros(b, jnp.int32), jnp.ones(b, bool), probs[:, 0]
    for d in range(tree.depth):
        q = child_probs[rows, cur]
        found, nxt = jnp.zeros(b, bool), cur
        for i in range(width):
            child = children[rows, cur, i]
            node = jnp.maximum(child, 0)
            tok = tokens[rows, node]
            tries = going & ~found & (child >= 0) & valid[rows, node]
            u = jax.random.uniform(keys[d * width + i], (b,))
            take = tries & (u < accept_probability(r[rows, tok], q[rows, tok]))
            found, nxt = found | take, jnp.where(take, child, nxt)
            rejected = (tries & ~take)[:, None]
            r = jnp.where(rejected, _normalized(jnp.maximum(r - q, 0.0)), r)
            q = jnp.where(rejected, _normalized(q.at[rows, tok].set(0.0)), q)
        going, cur = going & found, nxt
        r = jnp.where(found[:, None], probs[rows, cur], r)
    final = draw_from_probs(keys[-1], r)
    return cur, final


def score(params, cache, length, last, nodes, *, config: ModelConfig, tree: TreeArrays):
    """The full target over [root + nodes]: (logits [B, N, V], cache with every node's K/V in its scratch slot)."""
    tokens = jnp.concatenate([last[:, None], nodes], axis=1)
    positions = length[:, None] + tree.depths
    decoder = Decoder(config)
    hidden, cache = decoder.apply({"params": params}, tokens, positions, cache, length, tree_mask(length, tree))
    return decoder.apply({"params": params}, hidden, method="logits"), cache


def accept(logits, last, nodes, valid, *, tree: TreeArrays, sampling: Sampling = Sampling(), child_probs=None,
           key=None):
    """The target's verdict on a drafted tree: (accepted drafts a [B], emitted [B, D+1], path [B, D+1]).

    emitted[:, :a+1] are the a accepted tokens followed by the bonus token (greedy: the target's
    argmax after the deepest accepted node; sampled: a draw from the target, or from the residual
    where a draft was rejected); the rest is padding. `path` lists the accepted nodes root first.
    Sampling needs the drafter's `child_probs` and a PRNG `key`.
    """
    tokens = jnp.concatenate([last[:, None], nodes], axis=1)
    rows = jnp.arange(tokens.shape[0])
    valid = jnp.concatenate([jnp.ones_like(valid[:, :1]), valid], 1)
    if sampling.greedy:
        target = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        accepted = greedy_accept(tokens, target, valid, tree)
        deepest = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # one accepted node per depth, so unique
        path = tree.paths[rows, deepest]                                     # [B, D+1]
        emitted = jnp.take_along_axis(target, path, 1)
    else:
        probs = jax.nn.softmax(process_logits(logits, sampling), axis=-1)
        deepest, final = sample_accept(tokens, probs, child_probs, valid, key, tree)
        path = tree.paths[rows, deepest]
        drafted = jnp.take_along_axis(tokens, jnp.concatenate([path[:, 1:], path[:, -1:]], 1), 1)
        depth = tree.depths[rows, deepest]
        emitted = jnp.where(jnp.arange(tree.depth + 1)[None] == depth[:, None], final[:, None], drafted)
    return tree.depths[rows, deepest], emitted, path


def verify(params, cache, length, last, nodes, valid, *, config: ModelConfig, tree: TreeArrays,
           sampling: Sampling = Sampling(), child_probs=None, key=None, chain: bool = False):
    """score + settle: (cache with the accepted path committed, accepted [B], emitted, path)."""
    logits, cache = score(params, cache, length, last, nodes, config=config, tree=tree)
    return settle(logits, cache, length, last, nodes, valid, tree=tree, sampling=sampling, child_probs=child_probs,
                  key=key, chain=chain)


def settle(logits, cache, length, last, nodes, valid, *, tree: TreeArrays, sampling: Sampling = Sampling(),
           child_probs=None, key=None, chain: bool = False):
    """accept + commit over scored nodes: (cache with the accepted path committed, accepted [B], emitted, path).
    `chain`: `tree` is a chain (static), whose commit moves nothing."""
    accepted, emitted, path = accept(logits, last, nodes, valid, tree=tree, sampling=sampling,
                                     child_probs=child_probs, key=key)
    return commit_path(cache, length, path, tree.num_nodes, chain), accepted, emitted, path


def commit_path(cache, length, path, num_nodes: int, chain: bool = False):
    """Move the K/V of the accepted path (node indices [B, D+1], root first) to slots length .. length+D.

    Entries past the accepted depth repeat the deepest node: they land beyond the new length, where
    nothing reads them. A chain's accepted nodes sit in those slots already, so with `chain` nothing moves (on a GPU
    the moves were two launches a layer every step).
    """
    if chain:
        return cache

    def move(buf, start, idx):
        slab = jax.lax.dynamic_slice_in_dim(buf, start, num_nodes, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(buf, slab[idx], start, axis=0)

    move = jax.vmap(move)
    return [{name: move(buf, length, path) for name, buf in layer.items()} for layer in cache]
