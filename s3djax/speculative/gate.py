"""When a speculative step pays, measured on the machine at hand: the pause gate's breakeven.

A step that drafts costs `draft_s`, a step that does not (the target's own) `pause_s`; drafting pays
while it commits more than draft_s / pause_s tokens a step, that is while the drafts accepted per
step reach `breakeven = draft_s / pause_s - 1`. The loop (`s3djax.speculative.loop`) compares this
with the acceptance it expects. Where a drafter's steps differ in cost (one giving way to prompt lookup
runs no model at a step lookup drafts, `Drafter.free`), such a step has its own `free_s` and
`breakeven_free`: one figure for both was whatever mix of steps the measurement happened to take
(docs/sampling.md). The step times are measured once per machine, decoder and weights' shapes, in the
decoder's own compiled loop (forcing every step to draft by the model, freely where it can, then none),
and cached in the user's cache folder.

Whether the gate is on: `--pause` (configs/defaults.yaml where unset), overridden by S3DJAX_TUNE=on, off or
again (on, measured anew). docs/sampling.md#pausing-when-drafts-stop-paying has what it gained and lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from s3djax import defaults, device, user_cache

ENV = "S3DJAX_TUNE"
TABLE = "step-costs.json"
# The timing text: every step time measured on the machine (the gate's, a depth's, a batch's) is of the model decoding
# its own continuation of it.
PROMPT = "Summarize the plot of a famous novel in a few sentences, then say why it is still read today."
# Tokens decoded in each timed stretch: a warm-up, then drafting (by the model, then freely where the drafter has
# free steps) and pausing three times each, interleaved, the fastest of each kept: another process taking the cores
# makes a stretch slower, never faster, and shorter stretches proved too noisy on a shared machine (docs/sampling.md).
STRETCHES = (("draft", 4),) + (("draft", 32), ("free", 32), ("pause", 16)) * 3
# Bumped where what is measured changes, so that a cached figure measured otherwise is measured anew.
VERSION = 2


def key(decoder, params) -> str:
    """What the step times depend on: the machine (its CPU or GPU and jax), the decoder (model shape, method,
    tree, plan, sampling, cache length) and the weights' shapes and dtypes."""
    shapes = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(params) if hasattr(a, "shape")]
    text = json.dumps([VERSION, device.describe(), repr(decoder), shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def read() -> dict:
    return user_cache.read_table(TABLE, lambda entry: isinstance(entry.get("breakeven"), (int, float)))


def measure(runner, prompt_ids: list[int]) -> dict | None:
    """Seconds per drafting step by the model and per paused step, and where the drafter has free steps, per free
    step, in the runner's compiled loop on `prompt_ids`' cache, from the stretches the cache has room for; None where
    it has none for drafting or pausing."""
    d, params = runner.decoder, runner.params
    drafter = d.drafter
    state = runner.prefill(prompt_ids)
    decode = runner._compiled("decode", d.decode, state, jnp.int32(0))[0]
    best, free = {}, []  # free: (seconds, steps by the model, free steps) of each free stretch
    for i, (mode, tokens) in enumerate(STRETCHES):
        if mode == "free" and drafter.free is None:
            continue
        drafting = mode != "pause"
        counter = "iteration" if drafting else "paused"
        # An EOS does not end a timed stretch: what is decoded is never shown, only how long it took. A negative
        # idle count neither probes nor takes a drafter's hint (`loop`): a pausing stretch only pauses.
        state = {**state, "breakeven": jnp.float32(-math.inf if drafting else math.inf),
                 "breakeven_free": jnp.float32(-math.inf if drafting else math.inf),
                 "idle": jnp.int32(0 if drafting else -(1 << 30)), "done": jnp.zeros_like(state["done"])}
        if drafter.force is not None:
            state = {**state, "drafter": drafter.force(state["drafter"], mode == "free")}
        freed = free_steps(drafter, state) if mode == "free" else 0
        state, steps, seconds = stretch(decode, params, state, tokens, counter)
        if steps == 0:  # the cache is full
            break
        if not i:  # the first stretch only warms up
            continue
        if mode == "free":
            freed = free_steps(drafter, state) - freed
            free.append((seconds, steps - freed, freed))
        else:
            best[mode] = min(best.get(mode, math.inf), seconds / steps)
    if "draft" not in best or "pause" not in best:
        return None
    out = {"draft_s": best["draft"], "pause_s": best["pause"], "breakeven": best["draft"] / best["pause"] - 1}
    # A free stretch drafts by the model where a free draft cannot be had; those steps cost what the model's do.
    per_free = [(seconds - model * best["draft"]) / freed for seconds, model, freed in free if freed]
    if per_free:
        out["free_s"] = max(min(per_free), 0.0)
        out["breakeven_free"] = out["free_s"] / best["pause"] - 1
    return out


def stretch(decode, params, state, tokens: int, counter: str = "step"):
    """(state, steps, seconds): the compiled loop `decode` run on for `tokens` more tokens, the steps `counter` counts
    over them, and how long they took."""
    before, t = int(state[counter]), time.perf_counter()
    state = decode(params, state, jnp.int32(int(state["step"]) + tokens))
    steps = int(state[counter]) - before  # a sync: the stretch has run
    return state, steps, time.perf_counter() - t


def free_steps(drafter, state) -> int:
    """The steps so far whose draft ran no model (a drafter giving way to prompt lookup counts them)."""
    return drafter.stats(state["drafter"]).get("lookup_steps", 0) if drafter.free is not None else 0


def prompt_ids(tokenizer) -> list[int] | None:
    """PROMPT's ids; None where the model has no tokenizer to read it (a made-up model of the tests)."""
    from s3djax.tokenizer import encode_prompt

    return encode_prompt(tokenizer, PROMPT, False) if callable(tokenizer) else None


def tune(runner, prompt_ids, name: str, choice: str | None = None) -> float | None:
    """Set the runner's breakeven from the cache, else measure it (saying so in one line); None where the decoder
    has no gate, the gate is off, or the cache is too short to measure. On or off: S3DJAX_TUNE where set (`again`:
    on, measured anew), else `choice` (--pause), else configs/defaults.yaml's for the method `name`. `prompt_ids()`
    gives the prompt to measure on."""
    drafter = getattr(runner.decoder, "drafter", None)
    mode = (os.environ.get(ENV) or choice or defaults.fallback("pause", name) or "off").lower()
    if drafter is None or drafter.pause is None or mode not in ("on", "again"):
        return None
    runner.decoder = dataclasses.replace(runner.decoder, gate=True)  # the paused branch, compiled in
    k, table = key(runner.decoder, runner.params), read()
    if k not in table or mode == "again":
        print(f"measuring when {name}'s drafts pay on this machine (once)...", file=sys.stderr, flush=True)
        found = measure(runner, prompt_ids())
        if found is None:
            return None
        table = {**table, k: {**found, "device": device.describe(), "date": time.strftime("%Y-%m-%d")}}
        user_cache.write_table(TABLE, table)
    runner.overrides["breakeven"] = np.float32(table[k]["breakeven"])
    # A free step never measured (its stretches found no free draft) is weighed as the model's are.
    runner.overrides["breakeven_free"] = np.float32(table[k].get("breakeven_free", table[k]["breakeven"]))
    return table[k]["breakeven"]
