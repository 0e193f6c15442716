"""The speculative loop: draft -> verify -> accept -> commit, inside one jitted `lax.while_loop`.

`SpecDecoder` has the same start/decode/check_prompt interface as `ARDecoder`, so the host
`Runner` times and streams it the same way. Its params are the pair (target params, draft params).
A batch decodes each row on its own cursor: a step drafts and verifies every row together (one forward of all
their rows), and each row commits what it accepted; a row that has ended (EOS, its cache full, or its stop reached)
still computes in the step but commits nothing, writing only past its own committed length, which nothing reads.

The cache has `slack` slots past --max-cache-len, so a draft block and a tree always fit; the loop
stops where `ar` would (the committed length reaching max_cache_len), and the Runner's cap on new
tokens drops anything emitted past it, so output matches `ar` exactly at the boundary too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from s3djax.decode import ARDecoder, last_real

# The pause gate: the latest verify step's weight in the running acceptance (drafts accepted per step), and the most
# steps in a row that may pause before one drafts again to see whether drafts pay once more. A probe comes after 1
# paused step, then 2, 4, ... up to PROBE_EVERY while probes keep failing, so the start of a run of acceptances (code's
# come in runs) is missed by a step or two, not by PROBE_EVERY.
RATE_WEIGHT = 0.25
PROBE_EVERY = 8
# How far the expected acceptance follows the running one from the mean: its slope, fitted over the drafting steps so
# far, and before MIN_FIT of them, PRIOR_SLOPE (halfway).
PRIOR_SLOPE, MIN_FIT = 0.5, 16


def observe(fit, rate, accepted):
    """`fit` ([4]: the sums of r, a, r^2 and r a over the drafting steps) after a step that accepted `accepted` drafts
    where the running acceptance before it was `rate`."""
    r, a = rate.astype(jnp.float32), accepted.astype(jnp.float32)
    return fit + jnp.stack([r, a, r * r, r * a])


def gauge(depth: int) -> dict:
    """The gate's measures before any step: the running acceptance and the drafts accepted so far (`total`), both one
    optimistic pseudo-step of `depth`, and the fitted sums (`observe`)."""
    return {"rate": jnp.float32(depth), "total": jnp.float32(depth), "fit": jnp.zeros(4, jnp.float32)}


def recorded(g: dict, accepted) -> dict:
    """`gauge`'s measures after a drafting step that accepted `accepted` drafts."""
    return {"rate": (1 - RATE_WEIGHT) * g["rate"] + RATE_WEIGHT * accepted, "total": g["total"] + accepted,
            "fit": observe(g["fit"], g["rate"], accepted)}


def slope(fit, steps):
    """The least-squares slope of a step's accepted drafts on the running acceptance before it, over `steps` drafting
    steps, within [0, 1]: near 0 where acceptance does not persist from step to step (S3D's, whose misses are noise),
    high where it comes in runs (self-spec's and lookup's); PRIOR_SLOPE until MIN_FIT steps."""
    n = jnp.maximum(steps, 1).astype(jnp.float32)
    mean_r, mean_a = fit[0] / n, fit[1] / n
    var, cov = fit[2] / n - mean_r * mean_r, fit[3] / n - mean_r * mean_a
    fitted = jnp.clip(cov / jnp.maximum(var, 1e-6), 0.0, 1.0)
    return jnp.where((steps >= MIN_FIT) & (var > 1e-6), fitted, PRIOR_SLOPE)


def expected_acceptance(rate, total, steps, fit):
    """The drafts a step is expected to accept: the mean over every drafting step so far (`total` holds one optimistic
    pseudo-step), moved toward the running acceptance by how much a step's acceptance has followed it (`slope`). Where
    acceptance does not persist (s3d), a few misses in a row do not pause it; where it is low for long (self-spec,
    lookup at temperature 1), both are low."""
    mean = total / (steps + 1)
    return mean + slope(fit, steps) * (rate - mean)


@dataclasses.dataclass(frozen=True)
class SpecDecoder:
    ar: ARDecoder        # prefill, EOS and padding settings; its slack covers one block and one tree
    drafter: object      # see s3djax.speculative.drafters
    # The pause gate compiled in (`gate.tune` sets it where S3DJAX_TUNE turns the gate on). Off, the loop holds no
    # paused branch: a branch not taken still costs its launches where a step is counted in launches (a GPU).
    gate: bool = False

    @classmethod
    def create(cls, ar: ARDecoder, drafter, gate: bool = False) -> "SpecDecoder":
        if not ar.sampling.greedy:
            drafter.tree.check_sampling()
        # Slack covers the draft block, the tree's scratch slots and one step's output (depth + 1).
        return cls(dataclasses.replace(ar, slack=drafter.scratch_nodes), drafter, gate)

    @property
    def max_cache_len(self):
        return self.ar.max_cache_len

    @property
    def pad_id(self):
        return self.ar.pad_id

    @property
    def buffer_len(self) -> int:
        return self.ar.buffer_len

    def check_prompt(self, n: int) -> None:
        self.ar.check_prompt(n)

    def for_rows(self, n: int) -> "SpecDecoder":
        """The decoder for a batch of n rows: the pause gate weighs one row's acceptance, so a batch drafts every step
        (whether a batch drafts at all is chosen for its size, `defaults`)."""
        return self if n == 1 else dataclasses.replace(self, gate=False)

    def empty(self, params, batch: int) -> dict:
        if batch != 1 and self.gate:
            raise ValueError("the pause gate weighs one row: a batch decodes by `for_rows`")
        target, draft = params
        carry = self.ar.empty(target, batch)
        return {**carry, "drafter": self.drafter.init_state(target, draft, carry["cache"])}

    def resume(self, state) -> dict:
        return {**self.ar.resume(state), "drafter": self.drafter.resume(state["drafter"])}

    def prefill(self, params, carry, tokens, start, count):
        target, draft = params
        if self.drafter.prefill is not None:  # the drafter shares the target's prefill
            hidden, cache, dstate = self.drafter.prefill(target, draft, carry["drafter"], carry["cache"], tokens, start)
            return {**carry, "cache": cache, "drafter": dstate}, last_real(hidden, count)
        out, hidden = self.ar.prefill(target, carry, tokens, start, count)
        return {**out, "drafter": self.drafter.extend(target, draft, carry["drafter"], tokens, start, out["cache"])}, hidden

    def begin(self, params, carry, hidden, lengths, key):
        state = self.ar.begin(params[0], carry, hidden, lengths, key)
        # Per row and verify step, the drafts accepted and the depth drafted (-1: no step, or the row had ended); at
        # most one step per token. "cursor": each row's tokens so far; "step" (the host's stop) is the fewest a row
        # still decoding has.
        log = jnp.full((lengths.shape[0], self.ar.max_cache_len), -1, jnp.int32)
        return {**state, "drafter": carry["drafter"], "accepted_log": log, "drafted_log": log,
                "cursor": jnp.full(lengths.shape, state["step"]), "iteration": jnp.int32(0),
                # The pause gate (`decode`): running acceptance, steps since the last draft, the acceptance a step
                # must reach to pay (0: every step drafts, until `gate.tune` measures it) and that of a step whose
                # draft runs no model (`Drafter.free`), steps paused, paused steps before the next probe, the drafter's
                # hint from the last paused step, and the drafts accepted so far (with one optimistic pseudo-step, for
                # `expected_acceptance`'s mean).
                **gauge(self.drafter.tree.depth), "idle": jnp.int32(0), "breakeven": jnp.float32(0.0),
                "breakeven_free": jnp.float32(0.0),
                "paused": jnp.int32(0), "probe": jnp.int32(1), "hint": jnp.bool_(False)}

    def start(self, params, prompt, lengths, key):
        zeros = jnp.zeros_like(lengths, jnp.int32)
        carry, hidden = self.prefill(params, self.empty(params, prompt.shape[0]), prompt, zeros, lengths)
        return self.begin(params, carry, hidden, lengths, key)

    def decode(self, params, state, stop_at):
        target, draft = params
        tree, drafter, s_max = self.drafter.tree, self.drafter, self.ar.max_cache_len
        width, sampling = tree.depth + 1, self.ar.sampling

        def live(s):
            return ~s["done"] & (s["length"] < s_max)

        def going(s):  # stop_at: one for every row, or each row's own [B]
            return live(s) & (s["cursor"] < stop_at)

        def cond(s):
            return jnp.any(going(s))

        def drafting(s):
            key, draft_key, verify_key = jax.random.split(s["key"], 3)
            nodes, valid, child_probs, cache, dstate = drafter.draft(target, draft, s["cache"], s["length"], s["last"],
                                                                     s["drafter"], draft_key, sampling)
            cache, accepted, emitted, path, dstate = drafter.verify(target, draft, cache, s["length"], s["last"], nodes,
                                                                    valid, child_probs, dstate, verify_key, sampling)
            dstate = drafter.update(dstate, s["length"], accepted, path, emitted)
            # Tokens after an EOS inside the accepted path are dropped; a row that had ended, or reached its stop,
            # emits nothing.
            on = going(s)
            eos = self.ar.is_eos(emitted) & (jnp.arange(width)[None] <= accepted[:, None])
            n_out = jnp.where(on, jnp.where(eos.any(1), jnp.argmax(eos, axis=1) + 1, accepted + 1), 0)
            emitted = jnp.where(jnp.arange(width)[None] < n_out[:, None], emitted, self.ar.pad_id)
            rows = jnp.arange(emitted.shape[0])
            at = jnp.where(on[:, None], s["cursor"][:, None] + jnp.arange(width)[None], s["tokens"].shape[1])
            cursor = s["cursor"] + n_out
            node_depths = drafter.tree_arrays(dstate, valid.shape[0]).depths[:, 1:]
            g = recorded(s, accepted[0])  # the gate runs on one row (`for_rows`)
            # A probe that found drafts paying again resets the wait to one step; one that did not doubles it.
            pays = expected_acceptance(g["rate"], g["total"], s["iteration"] + 1, g["fit"]) >= s["breakeven"]
            probe = jnp.where(pays, 1, jnp.where(s["idle"] > 0, jnp.minimum(2 * s["probe"], PROBE_EVERY), s["probe"]))
            drafted = jnp.max(jnp.where(valid, node_depths, 0), axis=1)
            new = {"length": jnp.where(on, s["length"] + accepted + 1, s["length"]), "done": s["done"] | (eos.any(1) & on),
                   "cursor": cursor}
            ahead = going(new)
            return {**s, **new, "tokens": s["tokens"].at[rows[:, None], at].set(emitted, mode="drop"), "cache": cache,
                    "step": jnp.where(ahead.any(), jnp.min(jnp.where(ahead, cursor, cursor.max())), cursor.max()),
                    "last": jnp.where(on, emitted[rows, jnp.maximum(n_out, 1) - 1], s["last"]), "drafter": dstate,
                    "accepted_log": s["accepted_log"].at[:, s["iteration"]].set(jnp.where(on, accepted, -1)),
                    "drafted_log": s["drafted_log"].at[:, s["iteration"]].set(jnp.where(on, drafted, -1)),
                    "iteration": s["iteration"] + 1, "key": key,
                    **g, "idle": jnp.int32(0), "probe": probe,
                    "hint": jnp.bool_(False)}

        def paused(s):
            """A step without a draft: the target's own step, as `ar` takes it, and the drafter told of it."""
            dstate = drafter.pause(target, draft, s["cache"], s["length"], s["last"], s["drafter"])
            out = self.ar.advance(target, s)
            hint = jnp.bool_(False) if drafter.hint is None else drafter.hint(dstate, s["length"], out["last"])[0]
            return {**s, **out, "cursor": jnp.full_like(s["cursor"], out["step"]), "drafter": dstate,
                    "idle": s["idle"] + 1, "paused": s["paused"] + 1, "hint": hint}

        def body(s):
            if drafter.pause is None or not self.gate:
                return drafting(s)
            # A step drafts while the acceptance it expects pays for it, and to measure it again: after `probe` paused
            # steps, or where the drafter has a hint, after a paused step its draft would have begun right. All read
            # only the past, so each step's token keeps the target's distribution. Each branch is a loop of at most
            # one turn, not a `lax.cond`, which would copy the K/V cache.
            again = s["idle"] >= s["probe"] if drafter.hint is None else s["hint"] & (s["idle"] > 0)
            breakeven = s["breakeven"] if drafter.free is None else \
                jnp.where(drafter.free(s["drafter"], s["length"], s["last"])[0], s["breakeven_free"], s["breakeven"])
            draft_now = (expected_acceptance(s["rate"], s["total"], s["iteration"], s["fit"]) >= breakeven) | again
            s = jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), drafting(c[1])), (draft_now, s))[1]
            return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), paused(c[1])), (~draft_now, s))[1]

        return jax.lax.while_loop(cond, body, state)

    def stats(self, state, row: int | None = None) -> dict:
        """The acceptance of one row of the state's batch, or of all its rows pooled; the drafter's own, pooled."""
        log, drafted = (np.asarray(state[k]) if row is None else np.asarray(state[k])[row]
                        for k in ("accepted_log", "drafted_log"))
        log, drafted = log.ravel(), drafted[drafted >= 0]
        return {**acceptance(log[log >= 0], self.drafter.tree.depth),
                "mean_drafted": float(drafted.mean()) if drafted.size else 0.0, "drafted_per_step": drafted.tolist(),
                "paused_steps": int(state["paused"]), "gate_slope": float(slope(state["fit"], state["iteration"])),
                **self.drafter.stats(state["drafter"])}


def acceptance(accepted, depth: int) -> dict:
    """tau counts the bonus token: tokens emitted per verify step. alpha_k: P(depth k accepted | k-1 was).

    `accepted`: drafts accepted at each verify step (one run's, or several runs' pooled).
    """
    accepted = np.asarray(accepted, np.int64)
    hist = np.bincount(accepted, minlength=depth + 1)
    reached = hist[::-1].cumsum()[::-1]  # reached[k]: steps that accepted at least k drafts
    alpha = [float(reached[k] / reached[k - 1]) if reached[k - 1] else 0.0 for k in range(1, len(hist))]
    tau = float((accepted + 1).mean()) if accepted.size else 0.0
    return dict(mean_accepted_tokens=tau, acceptance_by_depth=alpha, verify_steps=int(accepted.size),
                accepted_per_step=accepted.tolist())
