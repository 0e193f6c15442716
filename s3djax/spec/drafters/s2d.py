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
  (tested), and the root's deepest exit proposes depth 1.
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
import numpy as np

from s3djax import cache as kv
from s3djax import model
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.layers import rms_norm
from s3djax.skip_plan import SkipPlan
from s3djax.spec.draft_params import init_draft
from s3djax.spec.drafters.chain import ChainDrafter
from s3djax.spec.tree import TreeSpec

ARTIFACT_KIND = "s2d nested draft"
FALLBACK_THRESHOLDS = (0.9, 0.8)  # untrained or unswept draft: only very confident shallow exits stop


def parse_exits(spec: str, num_layers: int) -> tuple[int, ...]:
    """"4,6,8" -> (4, 6, 8): increasing layer counts; the last is the draft's depth N_d < num_layers."""
    try:
        exits = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise UserError(f"invalid exits {spec!r}: expected layer counts such as 4,6,8") from None
    if not exits or any(b <= a for a, b in zip(exits, exits[1:])) or exits[0] < 1 or exits[-1] >= num_layers:
        raise UserError(f"invalid exits {spec!r}: layer counts must increase, from 1 to below the model's "
                        f"{num_layers} layers")
    return exits


def parse_thresholds(text: str, num_exits: int) -> tuple[float, ...]:
    """"a,b,c" -> the n-1 thresholds that matter: one per exit, the deepest's ignored (it always stops),
    so n-1 values are accepted too."""
    try:
        values = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UserError(f"invalid --thresholds {text!r}: expected numbers such as 0.8,0.6,0") from None
    if len(values) not in (num_exits - 1, num_exits) or any(v < 0 for v in values):
        raise UserError(f"--thresholds needs one non-negative value per exit ({num_exits}; the deepest exit always "
                        f"stops, so its value may be left out and is ignored), got {text!r}")
    return values[:num_exits - 1]


def first_exit(confidence, thresholds):
    """[B] int32: the first exit j whose confidence [B, n] reaches thresholds[j] ([n-1]); else the last."""
    n = confidence.shape[-1]
    passes = confidence[:, :n - 1] >= thresholds[None]
    passes = jnp.concatenate([passes, jnp.ones((passes.shape[0], 1), bool)], axis=1)
    return jnp.argmax(passes, axis=1).astype(jnp.int32)


def confidence(logits):
    """Top-1 probability of fp32 logits [..., V]."""
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def init_lora(params, config: ModelConfig, depth: int, rank: int, key) -> list[dict]:
    """Adapters on every linear of the first `depth` layers, B = 0 so they start as no-ops."""
    plan = SkipPlan.skipping_layers(config.num_layers, range(depth, config.num_layers))
    return init_draft(params, config, plan, lora_rank=rank, key=key)["lora"][:depth]


def target_key(quant_mode: str, dtype: str, full_mode: bool) -> str:
    """Which of the artifact's per-target default thresholds apply: float32, bfloat16, int8, int8-all or
    full-mode (a --target-from target, whatever its weights' form)."""
    return "full-mode" if full_mode else quant_mode if quant_mode != "none" else dtype


@dataclasses.dataclass(frozen=True)
class S2DDrafter(ChainDrafter):
    config: ModelConfig
    tree: TreeSpec
    exits: tuple[int, ...]  # layer counts; the last is the draft's depth N_d

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip((0,) + self.exits[:-1], self.exits))

    def _layers(self, params, draft):
        return draft["layers"] if "layers" in draft else params["layers"][:self.exits[-1]]

    def _segment(self, params, draft, j, x, positions, seg_cache, slot, mask):
        """Layers e_{j-1} .. e_j - 1 on their slice of the draft cache."""
        lo, hi = self.segments[j]
        lora = draft.get("lora")
        return model.run_layers({"layers": self._layers(params, draft)[lo:hi]}, x, positions, seg_cache, slot, mask,
                                config=self.config, lora=lora[lo:hi] if lora else None)

    def exit_logits(self, params, hidden):
        return model.logits(params, rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps))

    def full_depth(self, params, draft, tokens, positions, dcache, slot, mask):
        """Every segment, no exits: (hidden [B, T, D] after layer N_d, draft cache)."""
        x = model.embed(params, tokens)
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
        x = model.embed(params, tokens)
        logits = jnp.zeros((b, self.config.vocab_size), jnp.float32)
        stopped, exit_ = jnp.zeros(b, bool), jnp.full(b, n - 1, jnp.int32)
        for j, (lo, hi) in enumerate(self.segments):
            def run(c, j=j):
                x, seg_cache, logits, stopped, exit_ = c
                x, seg_cache = self._segment(params, draft, j, x, positions, seg_cache, slot, mask_at(j))
                if j == n - 1:
                    here, stop = self.exit_logits(params, x[:, 0]), jnp.ones(b, bool)
                else:  # a threshold above 1 can never pass: skip that exit's head
                    def scored(h):
                        out = self.exit_logits(params, h)
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

    def init_state(self, params, draft, prompt, lengths, cache):
        b, p = prompt.shape
        s = kv.cache_len(cache)
        dcache = kv.init_cache(self.config.replace(num_layers=self.exits[-1]), b, s, cache[0]["k"].dtype)
        zeros = jnp.zeros((b,), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, dcache = self.full_depth(params, draft, prompt, positions, dcache, zeros, kv.causal_mask(zeros, p, s))
        return {"cache": dcache,
                "history": jnp.zeros((b, s), jnp.int32).at[:, :p].set(prompt),   # committed token ids by slot
                "reached": jnp.full((b, s), len(self.exits), jnp.int32),          # segments each slot's K/V cover
                "exit_counts": jnp.zeros(len(self.exits), jnp.int32)}             # drafted tokens per exit

    def draft(self, params, draft, cache, length, last, state, key, sampling):
        """Block 0 (the committed tail and the root, full depth) here; ChainDrafter drafts the rest."""
        g, n = self.tree.depth, len(self.exits)
        b, s = last.shape[0], kv.cache_len(cache)
        history = kv.put_rows(state["history"], last[:, None], length)
        start = jnp.maximum(length - g, 0)
        tokens = jax.vmap(lambda h, at: jax.lax.dynamic_slice_in_dim(h, at, g + 1))(history, start)
        positions = start[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
        hidden, dcache = self.full_depth(params, draft, tokens, positions, state["cache"], start,
                                         kv.causal_mask(start, g + 1, s))
        root = jnp.take_along_axis(hidden, (length - start)[:, None, None], axis=1)[:, 0]
        reached = kv.put_rows(state["reached"], jnp.full((b, g + 1), n, jnp.int32), start)
        # The root's proposal was paid for at full depth: it comes from the deepest exit.
        state = {**state, "cache": dcache, "history": history, "reached": reached,
                 "exit_counts": state["exit_counts"].at[n - 1].add(b), "root_logits": self.exit_logits(params, root)}
        return super().draft(params, draft, cache, length, last, state, key, sampling)

    def block(self, params, draft, cache, state, tokens, positions, slot, mask):
        state = dict(state)
        if "root_logits" in state:  # ChainDrafter's block 0, already run by `draft` (a static branch)
            return state.pop("root_logits"), cache, state
        n, (b, t) = len(self.exits), tokens.shape
        reached = kv.put_rows(state["reached"], jnp.full((b, t), n, jnp.int32), slot)  # the block sees itself
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


def extra_bytes(params, draft) -> int:
    """The draft's parameter bytes not shared with the target (its memory cost beside the target)."""
    shared = {id(leaf) for leaf in jax.tree.leaves(params)}
    return sum(leaf.nbytes for leaf in jax.tree.leaves(draft) if id(leaf) not in shared)


def build_s2d(m, ar, opts, dtype: str):
    """`methods.build`'s s2d: the nested draft (opts.draft_path), its thresholds for this target, and the
    target itself: the loaded model, or with opts.target_from's full-mode S3D layers in place."""
    from s3djax.loading import DTYPES
    from s3djax.methods import Built, about_file, target_from
    from s3djax.spec import tree as trees
    from s3djax.spec.draft_params import load_artifact
    from s3djax.spec.drafters.chain import check_spine
    from s3djax.spec.loop import SpecDecoder

    path, warnings = opts.draft_path, []
    if path is None:
        raise UserError(f"no nested s2d draft is registered for {m.name}: train one with python -m train.s2d "
                        "and pass --draft PATH (or --draft none for the untrained nested draft)")
    if path == "none":
        exits, lora, meta = parse_exits(default_exits(m.config.num_layers), m.config.num_layers), None, {}
        warnings.append("no trained nested draft: its exits are the bare model's layers, so acceptance will be low")
    else:
        tree, meta = load_artifact(path, DTYPES[dtype], ARTIFACT_KIND)
        if meta.get("method") != "s2d":
            raise UserError(f"{path} is not an s2d nested draft (method {meta.get('method')!r})")
        exits = parse_exits(",".join(map(str, meta["exits"])), m.config.num_layers)
        lora = tree.get("lora")
        if lora is not None and not _fits(lora, m.params["layers"][:exits[-1]]):
            raise UserError(f"{path} was trained for a model of another shape than {m.name}")

    params, full_mode = m.params, opts.target_from is not None
    draft = {} if lora is None else {"lora": lora}
    if full_mode:
        params, finetuned = target_from(m, opts.target_from, dtype)
        if any(int(i) < exits[-1] for i in finetuned):  # the draft keeps the original layers
            draft["layers"] = m.params["layers"][:exits[-1]]

    key = target_key(m.quant, dtype, full_mode)
    if opts.thresholds:
        thresholds, source = parse_thresholds(opts.thresholds, len(exits)), "--thresholds"
    elif key in meta.get("thresholds", {}):
        thresholds, source = tuple(meta["thresholds"][key])[:len(exits) - 1], f"swept for {key}"
    else:
        thresholds, source = default_thresholds(len(exits)), "fallback"
    draft["thresholds"] = jnp.asarray(thresholds, jnp.float32)

    tree = check_spine(trees.resolve(opts.tree, opts.max_draft or 6), "s2d")
    drafter = S2DDrafter(m.config, tree, exits)
    if full_mode:
        warnings.append(f"verifying with {opts.target_from}'s fine-tuned layers, not the original weights")
    about = (f"nested draft {about_file(path if path != 'none' else None, meta)}, exits {','.join(map(str, exits))}, "
             f"thresholds {','.join(f'{t:g}' for t in thresholds)} ({source}), extra draft memory "
             f"{extra_bytes(params, draft) / 2**20:.1f} MiB")
    return Built(SpecDecoder.create(ar, drafter), (params, draft), warnings, about)


def _fits(lora, layers) -> bool:
    return len(lora) == len(layers) and all(
        name in layer and (adapter["a"].shape[0], adapter["b"].shape[1]) == tuple(layer[name].shape)
        for adapters, layer in zip(lora, layers) for name, adapter in adapters.items())


def default_exits(num_layers: int) -> str:
    """Without an artifact: exits at 2/15, 3/15 and 4/15 of the stack (4, 6, 8 of SmolLM2's 30 layers)."""
    exits = sorted({max(1, round(num_layers * f / 15)) for f in (2, 3, 4)} - {num_layers})
    return ",".join(map(str, exits or [max(1, num_layers - 1)]))


def default_thresholds(num_exits: int) -> tuple[float, ...]:
    return tuple(np.resize(FALLBACK_THRESHOLDS, num_exits - 1).tolist())
