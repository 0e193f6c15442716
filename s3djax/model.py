"""Llama and Phi-3 decoders as one Flax Linen module, applied pure-functionally.

`Decoder(config, plan).apply({"params": params}, tokens, positions, cache, slots, mask)`: `config`
and `plan` are static, hashable attributes, so a sub-layer the plan skips is never traced and every
(config, plan, shapes) combination compiles to exactly the work it does. The target and every draft
apply the same params tree; a draft is the same module with another plan.

Params (Flax's own tree): {"embed": [V, D], "layers_0" .. "layers_{L-1}": a `layers.Block`'s
{"attn_norm": {"scale"}, "attn": {"q", "k", "v", "o"} or {"qkv", "o"}, "mlp_norm": {"scale"},
"mlp": {"gate", "up", "down"} or {"gate_up", "down"}}, "final_norm": {"scale"}, "lm_head": [V, D]
(absent when tied)}. The embedding and head are [V, D] tables, so tied and untied read alike.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from s3djax import cache as kv
from s3djax import quant
from s3djax.config import ModelConfig
from s3djax.layers import Block, RMSNorm, dense_init, rope_tables
from s3djax.skip_plan import DynamicPlan, SkipPlan


class Decoder(nn.Module):
    config: ModelConfig
    plan: SkipPlan | None = None  # None: every sub-layer

    def setup(self):
        c = self.config
        self.embed = self.param("embed", dense_init, (c.vocab_size, c.hidden_size))
        self.layers = [Block(c) for _ in range(c.num_layers)]
        self.final_norm = RMSNorm(c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", dense_init, (c.vocab_size, c.hidden_size))

    def __call__(self, tokens, positions, cache, slots, mask, *, embeds=None, lora=None, dynamic=None, rows=None):
        """Run new tokens through the layers the plan keeps, writing their K/V into the cache.

        tokens, positions: [B, T] int32 (positions are RoPE positions); slots: [B] int32, the first
        cache slot of each row's T new tokens; mask: [B, T, S] bool over cache slots after the write,
        or a `cache.PrefixTreeMask`. `embeds` [B, T, D] replaces the token embeddings (a draft's
        mask-token rows); `lora` is a per-layer list of {weight name: {"a", "b"}} low-rank updates.
        `rows`, a `DraftRows`, confines `lora` to some rows, which also skip what its plan skips.
        Returns (final-normed hidden states [B, T, D], cache). Skipped attention leaves its layer's
        cache untouched.
        """
        x = self.embed_tokens(tokens) if embeds is None else embeds
        x, cache = self.run_layers(x, positions, cache, slots, mask, lora=lora, dynamic=dynamic, rows=rows)
        return self.final_norm(x), cache

    def run_layers(self, x, positions, cache, slots, mask, *, lora=None, dynamic: DynamicPlan | None = None,
                   rows: DraftRows | None = None):
        """The residual stream through the sub-layers the plan keeps: (x, cache), no final norm.

        `dynamic`, a `DynamicPlan` of traced flags, overrides the static plan: one executable then
        serves every plan (what a plan search needs), and a skipped sub-layer still does no work.
        """
        assert rows is None or dynamic is None, "draft rows split a static plan's sub-layers"
        plan = dynamic if dynamic is not None else \
            (self.plan or SkipPlan.full(self.config.num_layers)).check(self.config.num_layers)
        rope = rope_tables(positions, jnp.asarray(self.config.rope_inv_freq()))
        lora = lora or [None] * self.config.num_layers
        new_cache = list(cache)
        static = isinstance(plan, SkipPlan) and not self.is_initializing()
        y = None  # a static plan's last sub-layer output, whose add the next norm takes (Block's `defer`)
        for i, block in enumerate(self.layers):
            if isinstance(plan, SkipPlan) and not (plan.attn[i] or plan.mlp[i]):
                continue
            if static and rows is None:
                (x, y), new_cache[i] = _block(self.variables["params"][f"layers_{i}"], x, cache[i], rope, slots, mask,
                                              lora[i], y, config=self.config, run_attn=plan.attn[i], run_mlp=plan.mlp[i],
                                              defer=True)
                continue
            x, y = (x if y is None else x + y), None
            if rows is not None:
                x, new_cache[i] = rows.block(self.variables["params"][f"layers_{i}"], i, x, cache[i], rope, slots,
                                             mask, lora[i], config=self.config, plan=plan)
            else:
                x, new_cache[i] = block(x, cache[i], rope=rope, slots=slots, mask=mask, lora=lora[i],
                                        run_attn=plan.attn[i], run_mlp=plan.mlp[i])
        return (x if y is None else x + y), new_cache

    def embed_tokens(self, tokens):
        return quant.take(self.embed, tokens)

    def exit_logits(self, x, head=None):
        """The final norm and LM head over a residual stream that left the stack early (exits, adapters);
        `head`: some rows of the LM head instead (a draft vocabulary's)."""
        return self.logits(self.final_norm(x), head)

    def logits(self, hidden, head=None):
        """LM-head logits in fp32 over final-normed states; `head`: some rows of it (a draft vocabulary's)."""
        if head is None:
            head = self.embed if self.config.tie_word_embeddings else self.lm_head
        return quant.head(hidden, head, self.config.cpu_kernel)


# Jitted so that a stack's layers of one shape are traced and lowered once, not once per layer: the
# program XLA compiles is the same (it inlines the calls), but tracing SmolLM2's 30 layers one by one was
# most of the time a decode loop took to build.
@functools.partial(jax.jit, static_argnames=("config", "run_attn", "run_mlp", "defer"))
def _block(params, x, layer_cache, rope, slots, mask, lora, residual=None, *, config: ModelConfig, run_attn: bool,
           run_mlp: bool, defer: bool = False):
    return Block(config, parent=None).apply({"params": params}, x, layer_cache, rope=rope, slots=slots, mask=mask,
                                            lora=lora, run_attn=run_attn, run_mlp=run_mlp, residual=residual,
                                            defer=defer)


class DraftRows(NamedTuple):
    """Draft rows inside another forward (S3D's draft blocks in the verify pass): rows flagged true run only
    the sub-layers `plan` keeps and take the LoRA updates; the others run the forward's own plan without
    them, exactly as they would alone."""
    plan: SkipPlan
    flags: tuple[bool, ...]  # [T], static

    def block(self, params, i: int, x, layer_cache, rope, slots, mask, lora, *, config: ModelConfig, plan: SkipPlan):
        draft = np.asarray(self.flags)
        lora = {**lora, "rows": jnp.asarray(draft)} if lora else lora
        parts = (("attn", plan.attn[i], self.plan.attn[i]), ("mlp", plan.mlp[i], self.plan.mlp[i]))
        if all(runs == keeps for _, runs, keeps in parts):
            return _block(params, x, layer_cache, rope, slots, mask, lora, config=config, run_attn=plan.attn[i],
                          run_mlp=plan.mlp[i])
        for part, runs, keeps in parts:  # one sub-layer at a time, the draft rows keeping their stream where they skip
            assert runs or not keeps, "draft rows run only sub-layers the forward runs"
            if runs:
                y, layer_cache = _block(params, x, layer_cache, rope, slots, mask, lora, config=config,
                                        run_attn=part == "attn", run_mlp=part == "mlp")
                x = y if keeps else jnp.where(draft[:, None], x, y)
        return x, layer_cache


def init_params(config: ModelConfig, key, dtype=jnp.float32) -> dict:
    """Random params from `Decoder.init` (tests, shape checks); real ones come from `s3djax.weights`."""
    # Jitted, so a 7B model in bf16 is never materialised in fp32 first.
    init = jax.jit(lambda k: jax.tree.map(lambda a: a.astype(dtype), Decoder(config).init(k, *example_inputs(config))["params"]))
    return init(key)


def random_params(config: ModelConfig, key, dtype=jnp.bfloat16) -> dict:
    """`init_params`'s tree (normal(0.02) weights, norm scales 1) drawn leaf by leaf: one small compile per distinct
    shape, where `init_params` compiles the whole forward (for a GPU, 100 s and more at SmolLM2's size)."""
    paths, tree = jax.tree_util.tree_flatten_with_path(abstract_params(config, dtype))
    return tree.unflatten([jnp.ones(s.shape, s.dtype) if path[-1].key == "scale" else
                           _normal(jax.random.fold_in(key, i), s.shape, jnp.dtype(s.dtype).name)
                           for i, (path, s) in enumerate(paths)])


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.lru_cache(maxsize=8)
def abstract_params(config: ModelConfig, dtype=jnp.float32) -> dict:
    """The params tree as `jax.ShapeDtypeStruct`s: shapes of any size at no memory cost."""
    return jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.key(0))


def example_inputs(config: ModelConfig):
    """One token at position 0 into a one-slot cache: the smallest valid `Decoder` call."""
    zeros = jnp.zeros((1,), jnp.int32)
    return zeros[:, None], zeros[:, None], kv.init_cache(config, 1, 1), zeros, kv.causal_mask(zeros, 1, 1)


def forward_sequence(params, tokens, *, config: ModelConfig, cache_dtype=None):
    """Whole sequences from position 0 into a fresh cache of their length: (final hidden [B, T, D], cache).

    Teacher-forced scoring and training's context pass; the cache takes the embedding's dtype
    unless `cache_dtype` says otherwise.
    """
    b, t = tokens.shape
    cache = kv.init_cache(config, b, t, cache_dtype or params["embed"].dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return Decoder(config).apply({"params": params}, tokens, positions, cache, zeros, kv.causal_mask(zeros, t, t))


# ----------------------------------------------------------------------------- the params tree's layers

def layer_key(i: int) -> str:
    return f"layers_{i}"


def layers_of(params: dict) -> list[dict]:
    """The per-layer subtrees, in order."""
    n = sum(k.startswith("layers_") for k in params)
    return [params[layer_key(i)] for i in range(n)]


def with_layers(params: dict, layers: dict) -> dict:
    """params with some layers' subtrees replaced or merged into: {i: {sub-module: {weight: array}}}."""
    new = dict(params)
    for i, subtree in layers.items():
        old = params[layer_key(int(i))]
        new[layer_key(int(i))] = {**old, **{k: {**old[k], **v} if isinstance(v, dict) and isinstance(old.get(k), dict)
                                            else v for k, v in subtree.items()}}
    return new
