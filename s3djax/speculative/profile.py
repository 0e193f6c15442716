"""Draft and verify step times, measured apart from the loop (which fuses them and cannot be split).

Each step is jitted alone and timed on a real decode state, so the main loop is never slowed by
instrumentation.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from s3djax.speculative.verify import verify


def ms_per_step(step, params, cache, repeats: int):
    """Run `step(params, cache) -> (cache, tokens)` `repeats` times in one fori_loop, carrying the cache as
    the real loop does (in place, no copies), and folding the tokens into the carry so nothing is elided.
    params go in as arguments: closed over, a 7B model's weights would be baked into the executable."""

    def run(params, cache):
        def body(_, carry):
            cache, acc = carry
            cache, tokens = step(params, cache)
            return cache, acc + tokens.sum()
        return jax.lax.fori_loop(0, repeats, body, (cache, jnp.int32(0)))

    run = jax.jit(run, donate_argnums=1)
    cache, acc = run(params, cache)
    jax.block_until_ready(acc)
    samples = []
    for _ in range(3):
        t = time.perf_counter()
        cache, acc = run(params, cache)
        jax.block_until_ready(acc)
        samples.append((time.perf_counter() - t) / repeats)
    return statistics.median(samples) * 1000, cache


def forward_step(ar, tokens, length):
    """`step(params, cache)`: `ar`'s forward over `tokens` [B, T] after `length` committed tokens (causal
    attention, logits at all T); T = 1 is its decode loop's body."""
    t = tokens.shape[1]

    def step(params, c):
        hidden, c = ar._step(params, tokens, length[:, None] + jnp.arange(t)[None], c, length, kv.causal(length, t))
        return c, jnp.argmax(ar._logits(params, hidden), axis=-1)
    return step


def step_times(decoder: SpecDecoder, params, state, *, trees: dict[str, TreeSpec] | None = None,
               repeats: int = 10) -> dict[str, float]:
    """Milliseconds for the AR step, the draft step and the verify step (of each tree given, default the
    decoder's), at the state's committed length. The state's cache is consumed."""
    drafter = decoder.drafter
    cache, length, last, dstate = state["cache"], state["length"], state["last"], state["drafter"]

    def verify_step(tree):
        nodes = jnp.zeros((1, tree.num_nodes - 1), jnp.int32)
        valid = jnp.ones(nodes.shape, bool)

        def step(params, c):
            if tree is drafter.tree:  # the drafter's own verification (Kangaroo's skips the shallow layers)
                c, _, emitted, _, _ = drafter.verify(*params, c, length, last, nodes, valid, None, dstate, None,
                                                     decoder.ar.sampling)
            else:
                c, _, emitted, _ = verify(params[0], c, length, last, nodes, valid, config=decoder.ar.config,
                                          tree=tree.arrays(1))
            return c, emitted
        return step

    ar_forward = forward_step(decoder.ar, last[:, None], length)  # `ar`'s own step, not a one-node tree

    def ar_step(params, c):
        return ar_forward(params[0], c)

    def draft_step(params, carry):
        # The drafter's state is carried too: a draft reading only its own cache (S2D's) would otherwise be
        # loop-invariant, and XLA would hoist it out of the timed loop.
        nodes, _, _, c, state = drafter.draft(*params, carry[0], length, last, carry[1], None, decoder.ar.sampling)
        return (c, state), nodes

    out = {}
    out["ar_step_ms"], cache = ms_per_step(ar_step, params, cache, repeats)
    out["draft_step_ms"], (cache, dstate) = ms_per_step(draft_step, params, (cache, dstate), repeats)
    for name, tree in (trees or {"verify": drafter.tree}).items():
        key = "verify_step_ms" if name == "verify" else f"verify_{name}_ms"
        out[key], cache = ms_per_step(verify_step(tree), params, cache, repeats)
    return out
