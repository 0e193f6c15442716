"""Prompt lookup: the draft is what followed the latest earlier occurrence of the last n tokens.

n runs from `ngram` down to 1, in the prompt and the output so far; the first n that occurs proposes the
up to `depth` tokens after its latest occurrence, as a chain. No model runs to draft, so a step costs one
verify forward over the chain. transformers' `prompt_lookup_num_tokens` and vLLM's n-gram speculator draft
from such matches too (transformers from the earliest occurrence); the latest, the nearest context, is
taken here. Measured: benchmarks/results/archive/lookup-depth-cpu-2026-11-25.md.

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

NGRAM = 3  # the longest n-gram matched where --ngram is not given


def propose(history, end, ngram: int, depth: int):
    """(tokens [B, depth], valid [B, depth], n [B]): what followed the latest match of history[end-n+1 .. end]
    that ends before `end`, for the largest n <= ngram with one (n = 0: none). Past the known history (slot
    `end`), or with no match, the tokens are invalid."""
    size = history.shape[1]
    rows, slots = jnp.arange(history.shape[0]), jnp.arange(size)[None]
    best, matched = jnp.full(end.shape, -1, jnp.int32), jnp.zeros(end.shape, jnp.int32)
    same = jnp.ones(history.shape, bool)
    for n in range(1, ngram + 1):
        # same[:, j]: the n tokens ending at slot j equal the n ending at `end` (a roll wraps only where j < n - 1)
        same = same & (jnp.roll(history, n - 1, axis=1) == history[rows, jnp.maximum(end - n + 1, 0)][:, None])
        hit = same & (slots >= n - 1) & (slots < end[:, None])
        latest = jnp.max(jnp.where(hit, slots, -1), axis=1).astype(jnp.int32)
        best, matched = jnp.where(latest >= 0, latest, best), jnp.where(latest >= 0, n, matched)
    at = best[:, None] + 1 + jnp.arange(depth, dtype=jnp.int32)[None]
    tokens = jnp.take_along_axis(history, jnp.minimum(at, size - 1), axis=1)
    return tokens, (best[:, None] >= 0) & (at <= end[:, None]), matched


@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
    config: ModelConfig
    tree: TreeSpec  # a chain
    ngram: int = 3  # the longest n-gram matched

    @property
    def gamma(self) -> int:
        return self.tree.depth

    def init_state(self, params, draft, cache):
        return init_history(cache, self.tree.depth)

    def extend(self, params, draft, history, tokens, start, cache):
        return kv.put_rows(history, tokens, start)

    def draft(self, params, draft, cache, length, last, history, key, sampling: Sampling):
        history, nodes, valid, _ = look_up(history, length, last, self.ngram, self.tree.depth)
        return nodes, valid, point_masses(nodes, self.config.vocab_size, sampling), cache, history

    def update(self, history, length, accepted, path, emitted):
        return record(history, length, emitted)

    def pause(self, params, draft, cache, length, last, history):
        return history.at[jnp.arange(last.shape[0]), length].set(last)

    def hint(self, history, length, token):
        # A point mass on the proposal is accepted exactly where the target's own token is the proposal.
        proposed, known, _ = propose(history, length, self.ngram, 1)
        return known[:, 0] & (proposed[:, 0] == token)


def look_up(history, length, last, ngram: int, depth: int):
    """(history with `last` at slot `length`, then `propose`'s tokens, valid, n) from there."""
    history = history.at[jnp.arange(last.shape[0]), length].set(last)
    return history, *propose(history, length, ngram, depth)


def init_history(cache, depth: int):
    """Every token by slot: the prompt's (`kv.put_rows` of each chunk), then each step's output (`record`); the room
    past the cache takes the last step's overrun."""
    return jnp.zeros((cache[0]["k"].shape[0], kv.cache_len(cache) + depth + 1), jnp.int32)


def record(history, length, emitted):
    # emitted[:, i] sits at slot length + 1 + i; what lies past the accepted tokens is rewritten before it is read.
    return jax.vmap(lambda h, start, e: jax.lax.dynamic_update_slice(h, e, (start,)))(history, length + 1, emitted)


def point_masses(nodes, vocab_size: int, sampling: Sampling):
    """A chain's child_probs for sampled verification: node d's one child, nodes[:, d], drawn from a point mass."""
    if sampling.greedy:
        return None
    return jax.nn.one_hot(jnp.concatenate([nodes, nodes[:, -1:]], 1), vocab_size)


@dataclasses.dataclass(frozen=True)
class WithLookup(Drafter):
    """A chain drafter whose draft gives way to prompt lookup's at every step where the last `switch` or more
    tokens occurred before and lookup knows the whole chain.

    The chain stays the same size, so verification costs what it did; the model's draft is skipped where
    lookup drafts every row of the batch. Which source drafts depends on the history alone, never on a
    draw, so sampled verification stays exact.
    Where the inner drafter keeps more than the nodes (Kangaroo's exit states and adapter cache, Self-Spec's
    count of drafted tokens), its `gave_way` brings them up to date at the steps lookup drafts.
    """
    inner: Drafter
    switch: int = 2  # the shortest matching n-gram that switches a step to lookup's draft
    ngram: int = 3
    NEVER = 1 << 30  # a switch no match reaches (`force`)

    def __getattr__(self, name):
        # config, tree, gamma, plan ...: the inner drafter's (`inner` itself is missing only mid-construction)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def scratch_nodes(self) -> int:
        return self.inner.scratch_nodes

    def init_state(self, params, draft, cache):
        # The third part counts the steps lookup drafted (the model's draft skipped), for `stats`; the fourth is the
        # switch, in the state so that the gate's measurement can force either source without another compile.
        return (self.inner.init_state(params, draft, cache), init_history(cache, self.tree.depth), jnp.int32(0),
                jnp.int32(self.switch))

    def extend(self, params, draft, state, tokens, start, cache):
        inner, history, *rest = state
        return self.inner.extend(params, draft, inner, tokens, start, cache), kv.put_rows(history, tokens, start), *rest

    def resume(self, state):
        return self.inner.resume(state[0]), state[1], jnp.int32(0), jnp.int32(self.switch)

    def lookup_step(self, state, length, last):
        """(history with `last` recorded, lookup's chain, its validity, and whether lookup drafts the step after `last`
        at slot `length` [B]): where the last `switch` or more tokens occurred before and lookup knows the whole chain."""
        history, looked, known, n = look_up(state[1], length, last, self.ngram, self.tree.depth)
        return history, looked, known, (n >= state[3]) & known.all(1)

    def free(self, state, length, last):
        """Whether lookup drafts the step after `last` at slot `length` (the model's draft then skipped)."""
        return self.lookup_step(state, length, last)[3]

    def force(self, state, free: bool):
        return (*state[:3], jnp.int32(1 if free else self.NEVER))

    @property
    def prefill(self):
        if self.inner.prefill is None:
            return None

        def prefill(params, draft, state, cache, tokens, start):
            inner, history, *rest = state
            hidden, cache, inner = self.inner.prefill(params, draft, inner, cache, tokens, start)
            return hidden, cache, (inner, kv.put_rows(history, tokens, start), *rest)
        return prefill

    def tree_arrays(self, state, batch: int):
        return self.inner.tree_arrays(state[0], batch)

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        inner, _, looked_up, switch = state
        history, looked, known, use = self.lookup_step(state, length, last)
        if self.inner.gave_way is not None:
            # A drafter brought up to date by `gave_way` (Kangaroo's exit states, which its verification reads) is
            # either drafted or given way for every row of a batch at once: in a batch lookup drafts where all rows
            # have a match.
            use = use & jnp.all(use)
        masses = point_masses(looked, self.config.vocab_size, sampling)

        def drafted(c):
            _, nodes, valid, child_probs, cache, inner = c
            nodes, valid, child_probs, cache, inner = self.inner.draft(params, draft, cache, length, last, inner, key,
                                                                       sampling)
            if child_probs is not None:
                child_probs = child_probs.astype(masses.dtype)
            return jnp.bool_(False), nodes, valid, child_probs, cache, inner

        # The model drafts unless lookup drafts every row: a loop of at most one turn, not a `lax.cond`,
        # because a conditional copies the K/V cache in and out where a loop carries it in place.
        _, nodes, valid, child_probs, cache, inner = jax.lax.while_loop(
            lambda c: c[0], drafted, (~jnp.all(use), looked, known, masses, cache, inner))
        if self.inner.gave_way is not None:
            def gave_way(c):
                _, cache, inner = c
                return (jnp.bool_(False), *self.inner.gave_way(params, draft, cache, length, last, looked, inner))

            _, cache, inner = jax.lax.while_loop(lambda c: c[0], gave_way, (jnp.all(use), cache, inner))
        nodes, valid = jnp.where(use[:, None], looked, nodes), jnp.where(use[:, None], known, valid)
        if not sampling.greedy:
            child_probs = jnp.where(use[:, None, None], masses, child_probs)
        return nodes, valid, child_probs, cache, (inner, history, looked_up + jnp.all(use), switch)

    def verify(self, params, draft, cache, length, last, nodes, valid, child_probs, state, key, sampling: Sampling):
        *out, inner = self.inner.verify(params, draft, cache, length, last, nodes, valid, child_probs, state[0], key,
                                        sampling)
        return (*out, (inner, *state[1:]))

    def update(self, state, length, accepted, path, emitted):
        return (self.inner.update(state[0], length, accepted, path, emitted), record(state[1], length, emitted),
                *state[2:])

    @property
    def pause(self):
        if self.inner.pause is None:
            return None

        def pause(params, draft, cache, length, last, state):
            return (self.inner.pause(params, draft, cache, length, last, state[0]),
                    LookupDrafter.pause(self, params, draft, cache, length, last, state[1]), *state[2:])
        return pause

    def stats(self, state) -> dict:
        return {"lookup_steps": int(state[2])}


def build(m, ar, opts, dtype: str, measure: bool):
    """`--method lookup`: n-grams from --ngram down to 1, a chain of --max-draft (chosen on this machine where
    unset)."""
    from s3djax.built import Built, chosen_depth
    from s3djax.errors import UserError
    from s3djax.speculative.loop import SpecDecoder

    if opts.draft_path not in (None, "none"):
        raise UserError(f"lookup drafts from the prompt and output, with no draft file (got {opts.draft_path})")
    if opts.tree not in (None, "chain"):
        raise UserError(f"lookup drafts one continuation, so its tree is the chain, not {opts.tree}")
    ngram = NGRAM if opts.ngram is None else opts.ngram
    if ngram < 1:
        raise UserError(f"--ngram must be at least 1, got {ngram}")
    chosen = chosen_depth("lookup", m, ar, opts, dtype, measure, gives_way=False) if opts.max_draft is None else None
    tree = TreeSpec.chain(opts.max_draft or chosen.depth)
    return Built(SpecDecoder.create(ar, LookupDrafter(m.config, tree, ngram)), (m.params, {}), [],
                 f"prompt lookup, n-grams {ngram} to 1, max draft {tree.depth}" + (f" ({chosen.how})" if chosen else ""),
                 chosen)
