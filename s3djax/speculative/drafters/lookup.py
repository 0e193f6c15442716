"""Prompt lookup: the draft is what followed the latest earlier occurrence of the last n tokens.

n runs from `ngram` down to 1, in the prompt and the output so far; the first n that occurs proposes the
up to `depth` tokens after its latest occurrence, as a chain. No model runs to draft, so a step costs one
verify forward over the chain. transformers' `prompt_lookup_num_tokens` and vLLM's n-gram speculator draft
from such matches too (transformers from the earliest occurrence); the latest, the nearest context, is
taken here. Measured: benchmarks/results/lookup-depth-cpu-2026-11-25.md.

Sampling stays lossless: a lookup draft is a draw from a point mass, so verification accepts it with the
target's probability of that token and otherwise samples the residual without it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.sampling import Sampling
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.tree import TreeSpec


def propose(history, end, ngram: int, depth: int):
    """(tokens [B, depth], valid [B, depth]): what followed the latest match of history[end-n+1 .. end]
    that ends before `end`, for the largest n <= ngram with one. Past the known history (slot `end`), or
    with no match, the tokens are invalid."""
    size = history.shape[1]
    rows, slots = jnp.arange(history.shape[0]), jnp.arange(size)[None]
    best = jnp.full(end.shape, -1, jnp.int32)
    same = jnp.ones(history.shape, bool)
    for n in range(1, ngram + 1):
        # same[:, j]: the n tokens ending at slot j equal the n ending at `end` (a roll wraps only where j < n - 1)
        same = same & (jnp.roll(history, n - 1, axis=1) == history[rows, jnp.maximum(end - n + 1, 0)][:, None])
        hit = same & (slots >= n - 1) & (slots < end[:, None])
        latest = jnp.max(jnp.where(hit, slots, -1), axis=1).astype(jnp.int32)
        best = jnp.where(latest >= 0, latest, best)
    at = best[:, None] + 1 + jnp.arange(depth, dtype=jnp.int32)[None]
    tokens = jnp.take_along_axis(history, jnp.minimum(at, size - 1), axis=1)
    return tokens, (best[:, None] >= 0) & (at <= end[:, None])


@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
    config: ModelConfig
    tree: TreeSpec  # a chain
    ngram: int = 3  # the longest n-gram matched

    @property
    def gamma(self) -> int:
        return self.tree.depth

    def init_state(self, params, draft, prompt, lengths, cache):
        """Every token by slot: the prompt now, then each step's output (`update`); the room past the cache
        takes the last step's overrun."""
        history = jnp.zeros((prompt.shape[0], kv.cache_len(cache) + self.tree.depth + 1), jnp.int32)
        return jax.lax.dynamic_update_slice(history, prompt.astype(jnp.int32), (0, 0))

    def draft(self, params, draft, cache, length, last, history, key, sampling: Sampling):
        history = history.at[jnp.arange(last.shape[0]), length].set(last)
        nodes, valid = propose(history, length, self.ngram, self.tree.depth)
        child_probs = None
        if not sampling.greedy:  # node d's one child is nodes[:, d], drawn from a point mass
            child_probs = jax.nn.one_hot(jnp.concatenate([nodes, nodes[:, -1:]], 1), self.config.vocab_size)
        return nodes, valid, child_probs, cache, history

    def update(self, history, length, accepted, path, emitted):
        # emitted[:, i] sits at slot length + 1 + i; what lies past the accepted tokens is rewritten before it is read.
        return jax.vmap(lambda h, start, e: jax.lax.dynamic_update_slice(h, e, (start,)))(history, length + 1, emitted)
