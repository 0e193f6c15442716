"""Draft and verify step times, measured apart from the loop (which fuses them and cannot be split).

Each step is jitted alone and timed on a real decode state, so the main loop is never slowed by
instrumentation.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax import compile_options
from s3djax.speculative.loop import SpecDecoder
from s3djax.speculative.tree import TreeSpec
from s3djax.speculative.verify import verify


def compiled_loop(step, params, carry, repeats: int):
    """`step(params, carry) -> (carry, tokens)` run `repeats` times in one jitted fori_loop, carrying the cache as
    the real loop does (in place, no copies), the tokens folded into the carry so nothing is elided; compiled and
    run once. Returns (run(params, carry) -> (carry, acc), the carry after that run). params go in as arguments:
    closed over, a 7B model's weights would be baked into the executable."""

    def run(params, carry):
        def body(_, state):
            carry, acc = state
            carry, tokens = step(params, carry)
            return carry, acc + tokens.sum()
        return jax.lax.fori_loop(0, repeats, body, (carry, jnp.int32(0)))

    run = jax.jit(run, donate_argnums=1, compiler_options=compile_options.for_step(params))  # as the Runner compiles
    carry, acc = run(params, carry)
    jax.block_until_ready(acc)
    return run, carry


def ms_per_step(step, params, cache, repeats: int):
    """Milliseconds a step takes (`compiled_loop`'s loop, the fastest of 3 runs: another process slows a run, never
    speeds it), and the carry after."""
    ms, cache = ms_per_steps({0: step}, params, cache, repeats)
    return ms[0], cache


def ms_per_steps(steps: dict, params, carry, repeats: int, rounds: int = 3):
    """({name: milliseconds a step takes}, the carry after) for each of `steps` (sharing one carry's shapes), their
    compiled loops run in turn `rounds` times (`take_turns`), each step's fastest run kept (another process slows a
    run, never speeds it)."""
    runs = {}
    for name, step in steps.items():
        runs[name], carry = compiled_loop(step, params, carry, repeats)
    box = [carry]

    def timer(run):
        def once() -> float:
            t = time.perf_counter()
            box[0], acc = run(params, box[0])
            jax.block_until_ready(acc)
            return (time.perf_counter() - t) / repeats * 1000
        return once
    times = {name: [] for name in runs}
    take_turns({name: timer(run) for name, run in runs.items()}, times, rounds)
    return {name: min(ms) for name, ms in times.items()}, box[0]


def take_turns(timers: dict, times: dict, rounds: int = 1) -> None:
    """`rounds` more rounds of `timers` ({name: a function timing one more run, None where nothing ran}), a run each
    a round, in turn, each one's time appended to `times[name]`. Taking turns puts a slow spell of the machine on
    every timer alike, where timing one after another put it on whichever ran then (on a shared machine the first
    loop a process timed often read slowest, docs/defaults.md)."""
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())


def forward_step(ar, tokens, length):
    """`step(params, cache)`: `ar`'s forward over `tokens` [B, T] after `length` committed tokens (causal
    attention, logits at all T); T = 1 is its decode loop's body."""
    t = tokens.shape[1]

    def step(params, c):
        hidden, c = ar._step(params, tokens, length[:, None] + jnp.arange(t)[None], c, length, kv.causal(length, t))
        return c, jnp.argmax(ar._logits(params, hidden), axis=-1)
    return step


def step_functions(decoder, trees: dict[str, TreeSpec] | None = None) -> dict:
    """`{name: step}`, each `step(params, carry, length, last) -> (carry, tokens)` with carry (cache, drafter
    state): the AR step, and for a `SpecDecoder` its draft step and the verify step of each tree given
    (default the decoder's). Every input is an argument, so a step can also be compiled ahead of time on
    abstract shapes (benchmarks.h100_compile)."""
    spec = isinstance(decoder, SpecDecoder)
    ar = decoder.ar if spec else decoder

    def ar_step(params, carry, length, last):  # `ar`'s own step, not a one-node tree
        cache, state = carry
        cache, tokens = forward_step(ar, last[:, None], length)(params[0] if spec else params, cache)
        return (cache, state), tokens

    out = {"ar_step_ms": ar_step}
    if not spec:
        return out
    drafter = decoder.drafter

    def draft_step(params, carry, length, last):
        # The drafter's state is carried too: a draft reading only its own cache (S2D's) would otherwise be
        # loop-invariant, and XLA would hoist it out of the timed loop.
        nodes, _, _, cache, state = drafter.draft(*params, carry[0], length, last, carry[1], None, decoder.ar.sampling)
        return (cache, state), nodes

    def verify_step(tree):
        def step(params, carry, length, last):
            cache, state = carry
            nodes = jnp.zeros((last.shape[0], tree.num_nodes - 1), jnp.int32)
            valid = jnp.ones(nodes.shape, bool)
            if tree is drafter.tree:  # the drafter's own verification (Kangaroo's skips the shallow layers)
                cache, _, emitted, _, _ = drafter.verify(*params, cache, length, last, nodes, valid, None, state, None,
                                                         decoder.ar.sampling)
            else:
                cache, _, emitted, _ = verify(params[0], cache, length, last, nodes, valid, config=decoder.ar.config,
                                              tree=tree.arrays(last.shape[0]))
            return (cache, state), emitted
        return step

    out["draft_step_ms"] = draft_step
    for name, tree in (trees or {"verify": drafter.tree}).items():
        out["verify_step_ms" if name == "verify" else f"verify_{name}_ms"] = verify_step(tree)
    return out


def step_times(decoder: SpecDecoder, params, state, *, trees: dict[str, TreeSpec] | None = None,
               repeats: int = 10) -> dict[str, float]:
    """Milliseconds for the AR step, the draft step and the verify step (of each tree given, default the
    decoder's), at the state's committed length. The state's cache is consumed."""
    length, last = state["length"], state["last"]
    steps = {key: (lambda p, c, step=step: step(p, c, length, last))
             for key, step in step_functions(decoder, trees).items()}
    return ms_per_steps(steps, params, (state["cache"], state["drafter"]), repeats)[0]
