"""Llama and Phi-3 decoders as pure functions of a params pytree.

`config` and `plan` are static: a sub-layer the plan skips is never traced, so every
(config, plan, shapes) combination compiles to exactly the work it does.

Params: {"embed": [V, D], "layers": [per-layer dict], "final_norm": [D], "lm_head": [V, D] (absent
when tied)}. Linear weights are [in, out]; Llama layers hold q/k/v/gate/up, Phi-3 layers the fused
qkv and gate_up it ships with. Any of them may be a `quant.Int8Weight`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax import quant
from s3djax.config import ModelConfig
from s3djax.layers import apply_rope, attend, rms_norm, rope_tables, swiglu
from s3djax.skip_plan import DynamicPlan, SkipPlan


def _linear(p, lora, name, h):
    """h @ W, plus the low-rank update (h @ A) @ B where a draft adapter covers this weight."""
    out = quant.dot(h, p[name])
    if lora and name in lora:
        out = out + (h @ lora[name]["a"]) @ lora[name]["b"]
    return out


def _qkv(p, lora, h, config: ModelConfig):
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    if "qkv" in p:
        qkv = _linear(p, lora, "qkv", h)
        return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]
    return _linear(p, lora, "q", h), _linear(p, lora, "k", h), _linear(p, lora, "v", h)


def _mlp(p, lora, h):
    if "gate_up" in p:
        gate, up = jnp.split(_linear(p, lora, "gate_up", h), 2, axis=-1)
    else:
        gate, up = _linear(p, lora, "gate", h), _linear(p, lora, "up", h)
    return _linear(p, lora, "down", swiglu(gate, up))


def attention_block(p, lora, x, layer_cache, *, cos, sin, slots, mask, config: ModelConfig):
    b, t, _ = x.shape
    q, k, v = _qkv(p, lora, rms_norm(x, p["attn_norm"], config.rms_norm_eps), config)
    q = apply_rope(q.reshape(b, t, config.num_heads, config.head_dim), cos, sin)
    k = apply_rope(k.reshape(b, t, config.num_kv_heads, config.head_dim), cos, sin)
    v = v.reshape(b, t, config.num_kv_heads, config.head_dim)
    layer_cache = kv.write(layer_cache, k, v, slots)
    new = (k.astype(layer_cache["k"].dtype), v.astype(layer_cache["v"].dtype))
    out = attend(q, layer_cache["k"], layer_cache["v"], mask, new, config.attention)
    return x + _linear(p, lora, "o", out), layer_cache


def mlp_block(p, lora, x, *, config: ModelConfig):
    return x + _mlp(p, lora, rms_norm(x, p["mlp_norm"], config.rms_norm_eps))


def forward(params, tokens, positions, cache, slots, mask, *, config: ModelConfig, plan=None, embeds=None,
            lora=None):
    """Run new tokens through the layers the plan keeps, writing their K/V into the cache.

    tokens, positions: [B, T] int32 (positions are RoPE positions); slots: [B] int32, the first
    cache slot of each row's T new tokens; mask: [B, T, S] bool over cache slots after the write.
    `embeds` [B, T, D] replaces the token embeddings (a draft's mask-token rows); `lora` is a
    per-layer list of {weight name: {"a", "b"}} low-rank updates (draft adapters).
    Returns (final-normed hidden states [B, T, D], cache). Layers whose attention is skipped keep
    their cache untouched.
    """
    x = embed(params, tokens) if embeds is None else embeds
    x, cache = run_layers(params, x, positions, cache, slots, mask, config=config, plan=plan, lora=lora)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), cache


def run_layers(params, x, positions, cache, slots, mask, *, config: ModelConfig, plan=None, lora=None):
    """The residual stream through the sub-layers the plan keeps: (x, cache), no final norm.

    `plan` is a static `SkipPlan` (skipped sub-layers are never traced) or a `DynamicPlan` of traced
    flags, under which each sub-layer is a `lax.cond`: one executable serves every plan, which is
    what a search over plans needs, and a skipped sub-layer still does no work.
    """
    cos, sin = rope_tables(positions, jnp.asarray(config.rope_inv_freq()))
    lora = lora or [None] * config.num_layers
    if isinstance(plan, DynamicPlan):
        run_attn, run_mlp = plan.attn, plan.mlp
    else:
        plan = (plan or SkipPlan.full(config.num_layers)).check(config.num_layers)
        run_attn, run_mlp = plan.attn, plan.mlp
    new_cache = []
    for i, (p, adapter, layer_cache) in enumerate(zip(params["layers"], lora, cache)):
        attn = functools.partial(attention_block, p, adapter, cos=cos, sin=sin, slots=slots, mask=mask, config=config)
        mlp = functools.partial(mlp_block, p, adapter, config=config)
        if isinstance(plan, DynamicPlan):
            x, layer_cache = jax.lax.cond(run_attn[i], lambda a: attn(*a), lambda a: a, (x, layer_cache))
            x = jax.lax.cond(run_mlp[i], mlp, lambda h: h, x)
        else:
            if run_attn[i]:
                x, layer_cache = attn(x, layer_cache)
            if run_mlp[i]:
                x = mlp(x)
        new_cache.append(layer_cache)
    return x, new_cache


def forward_sequence(params, tokens, *, config: ModelConfig, cache_dtype=None):
    """Whole sequences from position 0 into a fresh cache of their length: (final hidden [B, T, D], cache).

    Teacher-forced scoring and training's context pass; the cache takes the embedding's dtype
    unless `cache_dtype` says otherwise.
    """
    b, t = tokens.shape
    cache = kv.init_cache(config, b, t, cache_dtype or params["embed"].dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    return forward(params, tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache, zeros,
                   kv.causal_mask(zeros, t, t), config=config)


def embed(params, tokens):
    return quant.take(params["embed"], tokens)


def logits(params, hidden):
    """LM-head logits in fp32. The head is [V, D] like the embedding, so tied and untied read alike."""
    return quant.head(hidden, params.get("lm_head", params["embed"]))


def init_params(config: ModelConfig, key, dtype=jnp.float32) -> dict:
    """Random params (tests, shape checks); real ones come from `s3djax.weights`."""
    d, f = config.hidden_size, config.intermediate_size
    q, kvs = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    keys = iter(jax.random.split(key, 8 * config.num_layers + 2))

    def dense(*shape):
        return (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)

    layers = []
    for _ in range(config.num_layers):
        layer = {"attn_norm": jnp.ones(d, dtype), "mlp_norm": jnp.ones(d, dtype), "o": dense(q, d), "down": dense(f, d)}
        if config.arch == "phi3":
            layer.update(qkv=dense(d, q + 2 * kvs), gate_up=dense(d, 2 * f))
        else:
            layer.update(q=dense(d, q), k=dense(d, kvs), v=dense(d, kvs), gate=dense(d, f), up=dense(d, f))
        layers.append(layer)
    params = {"embed": dense(config.vocab_size, d), "layers": layers, "final_norm": jnp.ones(d, dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = dense(config.vocab_size, d)
    return params
