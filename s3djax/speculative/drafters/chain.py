"""Autoregressive drafting, one depth per forward, shared by Self-Spec, Kangaroo and S2D.

The tree is a spine (`TreeSpec.spine`): a chain of rank-0 tokens with the next-ranked candidates as
leaves beside it, width 1 being the plain chain. Block 0 is the root; block d (1 <= d <= depth) is
every node at depth d, which sit in consecutive scratch slots, so one forward runs them together and
each sees the committed prefix and its own ancestors. Only the chain node's logits propose depth
d + 1; a leaf is run too so that, if verify commits it, the drafter's own caches hold its K/V.

Drafting stops, inside the jitted loop and without recompiling, once the subclass's confidence test
fails or the tree is full; the depths left are masked invalid, and verification scores the whole
spine. (Verifying only as deep as was drafted, a `lax.switch` over prefix trees, cost more than it
saved: XLA copies the K/V cache into and out of a conditional that updates it, about half an AR step
on the 2-core CPU at cache 2048, and every node past the first costs little on a memory-bound device.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax.cache import PrefixTreeMask
from s3djax.errors import UserError
from s3djax.sampling import Sampling, draws, process_logits, top_k
from s3djax.speculative import draft_vocab
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.tree import TreeSpec, resolve


def spine(tree: str | None, max_draft: int | None, record: dict, paper_depth: int, method: str) -> TreeSpec:
    """The drafter's tree, which must be a spine (chain or topK). Options left unset (None) take what the
    draft's file records as measured fastest, else the chain at the paper's depth."""
    tree = resolve(tree or record.get("tree"), max_draft or record.get("max_draft") or paper_depth)
    if tree.spine_width is None:
        raise UserError(f"{method} drafts one token after another, so its tree must be chain or topK (top2, ...)")
    return tree


def chosen_spine(method: str, m, ar, opts, dtype: str, measure: bool, record: dict, paper_depth: int,
                 as_recorded: bool = True):
    """(`spine`, the `defaults.Choice` of its depth or None): a chain's max draft left unset is chosen on this machine
    by the speed model (`built.chosen_depth`), else it is the draft file's measured fastest, else the paper's.
    `as_recorded`: the drafter runs its file as its acceptance was recorded (no option that changes what it drafts
    overrides the file), without which the record does not apply."""
    from s3djax.built import chosen_depth

    chosen = None
    if opts.max_draft is None and (opts.tree or record.get("tree") or "chain") == "chain" and as_recorded:
        fixed = (record["max_draft"], "the draft file's max draft") if record.get("max_draft") else \
            (paper_depth, "the paper's max draft")
        chosen = chosen_depth(method, m, ar, opts, dtype, measure, fixed=fixed)
    return spine(opts.tree, opts.max_draft or (chosen and chosen.depth), record, paper_depth, method), chosen


def about_spine(tree: TreeSpec, chosen=None) -> str:
    return f"max draft {tree.depth}" + (f" ({chosen.how})" if chosen else "") + f", tree {tree.spine_name}"


class ChainDrafter(Drafter):
    """Subclasses are frozen dataclasses with `config` and `tree`, and define:
    - `block(params, draft, cache, state, tokens [B, T], positions [B, T], slot [B], mask)
      -> (logits of the block's first token [B, V], cache, state)`, V being the draft vocabulary's
      size where the draft has one;
      `mask` is a `PrefixTreeMask` (the committed prefix and the block's ancestors in the scratch tree),
      so attention reads only the occupied prefix;
    - `confident(state, probs [B, V]) -> [B] bool`: whether to draft the next depth from probs.
    `process_last_block`: run the deepest block too (its K/V or exit states are needed later).
    They may override `score` (Kangaroo verifies from its exit states).
    """
    process_last_block = False

    @property
    def gamma(self) -> int:
        return self.tree.depth

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        tree = self.tree
        k, depth, b = tree.max_rank + 1, tree.depth, last.shape[0]
        ancestors = jnp.asarray(tree.ancestors)
        keys = jax.random.split(key if key is not None else jax.random.key(0), depth + 1)

        def run(d, tokens, cache, state):
            first = jnp.where(d == 0, 0, 1 + (d - 1) * k)  # node index of the block's chain token
            rows = jax.lax.dynamic_slice_in_dim(ancestors, first, tokens.shape[1], axis=0)
            mask = PrefixTreeMask(length, jnp.broadcast_to(rows, (b,) + rows.shape))
            positions = jnp.broadcast_to(length[:, None] + d, tokens.shape)
            return self.block(params, draft, cache, state, tokens, positions, length + first, mask)

        def propose(d, logits, nodes, valid, child_probs, going, state):
            """Candidates for depth d + 1 from the chain node at depth d."""
            if sampling.greedy:
                probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
                candidates, ok = draft_vocab.token_ids(draft, top_k(logits, k)[1]), jnp.ones((b, k), bool)
            else:
                logq = jax.nn.log_softmax(process_logits(logits, sampling), axis=-1)
                probs = jnp.exp(logq)
                # k draws from q without replacement, in the order verification tries them.
                scores, candidates = draws(keys[d], logq, k)
                candidates, ok = draft_vocab.token_ids(draft, candidates), jnp.isfinite(scores)
                child_probs = child_probs.at[:, jnp.where(d == 0, 0, 1 + (d - 1) * k)].set(
                    draft_vocab.full_probs(draft, probs, self.config.vocab_size))
            going = going & self.confident(state, probs)
            nodes = jax.lax.dynamic_update_slice(nodes, candidates.astype(jnp.int32), (0, d * k))
            valid = jax.lax.dynamic_update_slice(valid, ok & going[:, None], (0, d * k))
            return nodes, valid, child_probs, going

        n = tree.num_nodes
        nodes, valid = jnp.zeros((b, n - 1), jnp.int32), jnp.zeros((b, n - 1), bool)
        child_probs = None if sampling.greedy else jnp.zeros((b, n, self.config.vocab_size), jnp.float32)
        logits, cache, state = run(0, last[:, None], cache, state)
        nodes, valid, child_probs, going = propose(0, logits, nodes, valid, child_probs, jnp.ones(b, bool), state)
        last_block = depth if self.process_last_block else depth - 1

        def cond(c):
            return (c[0] <= last_block) & jnp.any(c[4])

        def body(c):
            d, nodes, valid, child_probs, going, cache, state = c
            tokens = jax.lax.dynamic_slice_in_dim(nodes, (d - 1) * k, k, axis=1)
            logits, cache, state = run(d, tokens, cache, state)
            proposed = propose(d, logits, nodes, valid, child_probs, going, state)
            # The deepest block proposes nothing: it only ran for the caches.
            nodes, valid, child_probs, going = jax.tree.map(lambda new, old: jnp.where(d < depth, new, old), proposed,
                                                            (nodes, valid, child_probs, going & (d < depth)))
            return d + 1, nodes, valid, child_probs, going, cache, state

        _, nodes, valid, child_probs, _, cache, state = jax.lax.while_loop(
            cond, body, (jnp.int32(1), nodes, valid, child_probs, going, cache, state))
        return nodes, valid, child_probs, cache, state
