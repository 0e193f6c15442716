"""S2D (Kavehzadeh et al. 2024): a nested draft with several exits serves several targets.

The draft is the first N_d layers of the model, with exits e_1 < ... < e_n = N_d; every exit reads
the shared final norm and LM head (the verifying target's own, so nothing is duplicated). Sorted
fine-tuning (train.s2d) trains LoRA adapters on those layers with the mean of every exit's
next-token loss (the paper's Eq. 3), so each prefix of the stack is a usable draft. The base
layers are the original model's: for an unmodified target (float or int8) they are the target's
own arrays, and `draft` holds only the adapters and thresholds; a target whose first layers differ
(a full-mode S3D fine-tune) gets the original layers in `draft["layers"]`, which are then the
draft's only extra weights.

Drafting is ChainDrafter's spine (one depth per forward, a fixed `max_draft` tokens: the paper's
S2D has no stop rule, so `confident` is always true). Each chain token climbs the stack one
segment [e_{j-1}, e_j) at a time, each under a `lax.cond`, and stops at the first exit whose top-1
probability reaches that exit's threshold; the deepest exit always stops (so a threshold given for
it is ignored). Skipped segments cost nothing; a threshold above 1 also skips that exit's head.

Early exits leave holes: a token that stopped at e_j has no K/V at layers >= e_j. The draft keeps
its own cache (N_d layers, the target cache's slot layout) and a per-slot count of the segments
whose K/V each slot holds, and handles the holes in two places:
- within a step, a later token's segment j masks out the drafted slots that never reached it
  (the committed prefix is always visible), so nothing reads a stale entry;
- at the start of each step, block 0 is not just the root but the last gamma+1 committed tokens
  (slots max(length - gamma, 0) .. length, token ids from a history of committed tokens), run
  through all N_d layers. Every token the previous step accepted is among them, so after block 0
  every committed slot holds exactly the K/V a full-depth prefill of the committed text would
  (tested), and the root's deepest exit proposes depth 1. A step that drafts nothing (the pause gate's, or one
  that prompt lookup drafted) runs block 0 alone, so a run of them leaves no committed slot behind.
Why not CALM-style propagation (copying an exited token's last hidden state into the skipped
layers' K/V)? It is an approximation whose errors stay in the cache and compound over a long
generation, and it needs a projection at every skipped layer anyway. Recomputing gives an exact
committed context at a bounded price: one (gamma+1)-token forward through N_d layers per step,
which on an accelerator is memory-bound like a one-token step. It also makes the target's
`commit_path` unnecessary on the draft cache (block 0 rewrites every slot it would move), and the
deepest block need not run (`process_last_block` stays False): its K/V would be recomputed.

Thresholds are traced (`draft["thresholds"]`, one per exit but the last), so a sweep over them
reuses one executable; defaults per target kind (`target_key`) live in the artifact's metadata.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.model import Decoder, with_layers
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab, draft_weights
from s3djax.speculative.drafters.chain import ChainDrafter
from s3djax.speculative.tree import TreeSpec


def run_segment(config: ModelConfig, params, lo: int, hi: int, x, positions, seg_cache, slots, mask, *, lora=None):
    """Layers lo .. hi-1 over the residual stream x, on their slice of a cache: (x, the slice updated).

    The decoder under a plan that keeps only those layers, so no other layer's cache entry is read.
    """
    n = config.num_layers
    plan = SkipPlan.skipping_layers(n, [i for i in range(n) if not lo <= i < hi])
    cache = [None] * lo + list(seg_cache) + [None] * (n - hi)
    x, cache = Decoder(config, plan).apply({"params": params}, x, positions, cache, slots, mask, lora=lora,
                                           method="run_layers")
    return x, cache[lo:hi]


def first_exit(confidence, thresholds):
    """[B] int32: the first exit j whose confidence [B, n] reaches thresholds[j] ([n-1]); else the last."""
    n = confidence.shape[-1]
    passes = confidence[:, :n - 1] >= thresholds[None]
    passes = jnp.concatenate([passes, jnp.ones((passes.shape[0], 1), bool)], axis=1)
    return jnp.argmax(passes, axis=1).astype(jnp.int32)


def confidence(logits):
    """Top-1 probability of fp32 logits [..., V]."""
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


@dataclasses.dataclass(frozen=True)
class S2DDrafter(ChainDrafter):
    config: ModelConfig
    tree: TreeSpec
    exits: tuple[int, ...]  # layer counts; the last is the draft's depth N_d

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip((0,) + self.exits[:-1], self.exits))

    def _segment(self, params, draft, j, x, positions, seg_cache, slot, mask):
        """Layers e_{j-1} .. e_j - 1 on their slice of the draft cache."""
        if "layers" in draft:  # the original layers, where the target's differ
            params = with_layers(params, dict(enumerate(draft["layers"])))
        return run_segment(self.config, draft_weights.of(params, draft), *self.segments[j], x, positions, seg_cache,
                           slot, mask, lora=draft.get("lora"))

    def exit_logits(self, params, draft, hidden):
        """The shared final norm and LM head, or a draft vocabulary's rows of it."""
        return Decoder(self.config).apply({"params": params}, hidden, draft.get("head"), method="exit_logits")

    def embed(self, params, tokens):
        return Decoder(self.config).apply({"params": params}, tokens, method="embed_tokens")

    def full_depth(self, params, draft, tokens, positions, dcache, slot, mask):
        """Every segment, no exits: (hidden [B, T, D] after layer N_d, draft cache)."""
        x = self.embed(params, tokens)
        for j, (lo, hi) in enumerate(self.segments):
            x, new = self._segment(params, draft, j, x, positions, dcache[lo:hi], slot, mask)
            dcache = dcache[:lo] + new + dcache[hi:]
        return x, dcache

    def nested(self, params, draft, tokens, positions, dcache, slot, mask_at):
        """Segment by segment until the first token's confidence passes its exit's threshold.

        mask_at(j): the [B, T, S] mask of segment j. Returns (the first token's logits at its exit
        [B, V], the exit index [B], the draft cache).
        """
        n, b = len(self.exits), tokens.shape[0]
        thresholds = draft["thresholds"]
        x = self.embed(params, tokens)
        logits = jnp.zeros((b, draft_vocab.logits_width(draft, self.config.vocab_size)), jnp.float32)
        stopped, exit_ = jnp.zeros(b, bool), jnp.full(b, n - 1, jnp.int32)
        for j, (lo, hi) in enumerate(self.segments):
            def run(c, j=j):
                x, seg_cache, logits, stopped, exit_ = c
                x, seg_cache = self._segment(params, draft, j, x, positions, seg_cache, slot, mask_at(j))
                if j == n - 1:
                    here, stop = self.exit_logits(params, draft, x[:, 0]), jnp.ones(b, bool)
                else:  # a threshold above 1 can never pass: skip that exit's head
                    def scored(h):
                        out = self.exit_logits(params, draft, h)
                        return out, confidence(out)
                    here, conf = jax.lax.cond(thresholds[j] <= 1.0, scored,
                                              lambda h: (jnp.zeros_like(logits), jnp.zeros(b, jnp.float32)), x[:, 0])
                    stop = conf >= thresholds[j]
                new = ~stopped
                logits = jnp.where(new[:, None], here, logits)
                exit_ = jnp.where(new & stop, j, exit_)
                return x, seg_cache, logits, stopped | stop, exit_

            carry = (x, dcache[lo:hi], logits, stopped, exit_)
            carry = run(carry) if j == 0 else jax.lax.cond(jnp.all(stopped), lambda c: c, run, carry)
            x, seg, logits, stopped, exit_ = carry
            dcache = dcache[:lo] + list(seg) + dcache[hi:]
        return logits, exit_, dcache

    # ------------------------------------------------------------------------- the drafter interface

    def init_state(self, params, draft, cache):
        b, s = cache[0]["k"].shape[0], kv.cache_len(cache)
        return {"cache": kv.init_cache(self.config.replace(num_layers=self.exits[-1]), b, s, **kv.layout(cache)),
                "history": jnp.zeros((b, s), jnp.int32),                  # committed token ids by slot
                "reached": jnp.full((b, s), len(self.exits), jnp.int32),  # segments each slot's K/V cover
                "exit_counts": jnp.zeros(len(self.exits), jnp.int32)}     # drafted tokens per exit

    def extend(self, params, draft, state, tokens, start, cache):
        b, c = tokens.shape
        positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
        _, dcache = self.full_depth(params, draft, tokens, positions, state["cache"], start, kv.prompt_chunk(start, c))
        return {**state, "cache": dcache, "history": kv.put_rows(state["history"], tokens, start),
                "reached": kv.put_rows(state["reached"], jnp.full((b, c), len(self.exits), jnp.int32), start)}

    def resume(self, state):
        return {**state, "exit_counts": jnp.zeros_like(state["exit_counts"])}

    def _tail(self, params, draft, length, last, state):
        """Block 0: the committed tail and the root through all N_d layers, (the root's hidden state [B, D], state)."""
        g, n = self.tree.depth, len(self.exits)
        b = last.shape[0]
        history = kv.put_rows(state["history"], last[:, None], length)
        start = jnp.maximum(length - g, 0)
        tokens = jax.vmap(lambda h, at: jax.lax.dynamic_slice_in_dim(h, at, g + 1))(history, start)
        positions = start[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
        hidden, dcache = self.full_depth(params, draft, tokens, positions, state["cache"], start, kv.causal(start, g + 1))
        root = jnp.take_along_axis(hidden, (length - start)[:, None, None], axis=1)[:, 0]
        reached = kv.put_rows(state["reached"], jnp.full((b, g + 1), n, jnp.int32), start)
        return root, {**state, "cache": dcache, "history": history, "reached": reached}

    def draft(self, params, draft, cache, length, last, state, key, sampling):
        """Block 0 here; ChainDrafter drafts the rest."""
        root, state = self._tail(params, draft, length, last, state)
        # The root's proposal was paid for at full depth: it comes from the deepest exit.
        state = {**state, "exit_counts": state["exit_counts"].at[len(self.exits) - 1].add(last.shape[0]),
                 "root_logits": self.exit_logits(params, draft, root)}
        return super().draft(params, draft, cache, length, last, state, key, sampling)

    def pause(self, params, draft, cache, length, last, state):
        """A step that drafts nothing (the target's own on `last` at slot `length`): block 0 alone, since the next
        one reaches back only gamma slots and a run of such steps would otherwise leave committed slots it never
        recomputed. It also fills the holes of the drafted step before it, so no paused step reads one."""
        return self._tail(params, draft, length, last, state)[1]

    def gave_way(self, params, draft, cache, length, last, nodes, state):
        """Another source drafted the chain: block 0 alone, as at a paused step."""
        return cache, self.pause(params, draft, cache, length, last, state)

    def block(self, params, draft, cache, state, tokens, positions, slot, mask):
        state = dict(state)
        if "root_logits" in state:  # ChainDrafter's block 0, already run by `draft` (a static branch)
            return state.pop("root_logits"), cache, state
        n, (b, t) = len(self.exits), tokens.shape
        reached = kv.put_rows(state["reached"], jnp.full((b, t), n, jnp.int32), slot)  # the block sees itself
        mask = mask.dense(kv.cache_len(cache))  # each exit also hides the slots whose K/V stop below it
        logits, exit_, dcache = self.nested(params, draft, tokens, positions, state["cache"], slot,
                                            lambda j: mask & (reached > j)[:, None, :])
        reached = kv.put_rows(reached, jnp.broadcast_to(exit_[:, None] + 1, (b, t)), slot)
        counts = state["exit_counts"] + jnp.sum(jax.nn.one_hot(exit_, n, dtype=jnp.int32), axis=0)
        return logits, cache, {**state, "cache": dcache, "reached": reached, "exit_counts": counts}

    def confident(self, state, probs):
        return jnp.ones(probs.shape[:1], bool)

    def update(self, state, length, accepted, path, emitted):
        # Accepted drafts sit at length+1 .. length+a, the bonus at the new length; the rest of the
        # write lands in scratch. The draft cache needs no commit: the next block 0 recomputes them.
        return {**state, "history": kv.put_rows(state["history"], emitted, length + 1)}


