"""Kangaroo (Liu et al. 2024): the target's first l layers plus a small trained adapter draft one token at a
time until the draft's top-1 probability is <= eta; verification runs only layers l..L-1.

The draft model is layers 0..l-1 of the target (the exit layer l), then the adapter, then the shared
final norm and LM head. The adapter is one attention block with an input and an output RMSNorm and no
MLP: x + attention(RMSNorm_in(x)), then RMSNorm_out. The paper's Table 2 draws it as input LN +
attention + last LN feeding the shared head; we do what the issue asks, the output RMSNorm followed by
the target's own final norm and head. RMSNorm_out starts at weight 1, which makes the pair exactly the
paper's last LN initialised from the final norm; starting it from the final-norm weight instead would
apply that weight twice (SmolLM2's reaches 3.3), and measured held-out soft cross-entropy at step 0
was 65 nats against 17.

Work is shared, never repeated:
- drafting a token runs layers 0..l-1 on the target's own cache, so the shallow K/V of drafted tokens
  are real target K/V, written where verification would put them (node i at slot length + i);
- each drafted token's exit hidden state (the residual stream after layer l-1, before any norm) is
  kept in the drafter state, indexed by tree node, and verification runs layers l..L-1 over those,
  recomputing nothing below l (paper Fig. 2, the "parallel compute unit");
- the adapter keeps its own one-layer K/V cache in the target cache's slot layout, so the same
  `commit_path` keeps it consistent after a rejection or a full acceptance;
- the adapter's cache needs the prompt's exit states: `prefill` runs the target's prefill split at the
  exit layer and feeds the adapter from there, so a prompt costs the target's prefill and one layer.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax import quant
from s3djax.built import Built, about_file
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.layers import Attention, RMSNorm, rope_tables
from s3djax.model import Decoder, layer_key
from s3djax.sampling import Sampling
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab, draft_weights, verify
from s3djax.speculative.drafters.chain import ChainDrafter, about_spine, chosen_spine
from s3djax.speculative.tree import TreeArrays, TreeSpec


def default_exit_layer(num_layers: int) -> int:
    """Where an adapter exits unless told: the exit-layer sweep's choice for SmolLM2, 2 of 30 layers
    (benchmarks/results/archive/kangaroo-exit-sweep-cpu.md; the paper's for Vicuna-7B is 2 of 32), the same
    fraction of the depth elsewhere."""
    return max(1, min(num_layers - 1, round(num_layers / 15)))


def check_exit_layer(exit_layer: int, num_layers: int) -> int:
    if not 1 <= exit_layer < num_layers:
        raise UserError(f"the exit layer must be in 1..{num_layers - 1} for a {num_layers}-layer model, "
                        f"got {exit_layer}")
    return exit_layer


def shallow_plan(num_layers: int, exit_layer: int) -> SkipPlan:
    return SkipPlan.skipping_layers(num_layers, range(exit_layer, num_layers))


def deep_plan(num_layers: int, exit_layer: int) -> SkipPlan:
    return SkipPlan.skipping_layers(num_layers, range(exit_layer))


class Adapter(nn.Module):
    """x + attention(RMSNorm_in(x)), then RMSNorm_out: params {"attn_norm", "attn", "out_norm"}."""
    config: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, positions, slots, mask):
        c = self.config
        cos, sin = rope_tables(positions, jnp.asarray(c.rope_inv_freq()))
        y, layer_cache = Attention(c, name="attn")(RMSNorm(c.rms_norm_eps, name="attn_norm")(x), layer_cache, cos=cos,
                                                   sin=sin, slots=slots, mask=mask)
        return RMSNorm(c.rms_norm_eps, name="out_norm")(x + y), layer_cache


def init_adapter(params, config: ModelConfig, exit_layer: int) -> dict:
    """The adapter's starting point: layer l's attention weights (the layer the draft replaces) and a unit
    output norm (the shared final norm brings its weight). Float even where the target is int8."""
    layer = params[layer_key(exit_layer)]
    return {"attn_norm": layer["attn_norm"], "attn": quant.dequantize_tree(layer["attn"]),
            "out_norm": {"scale": jnp.ones_like(params["final_norm"]["scale"])}}


def nest_adapter(adapter: dict) -> dict:
    """An adapter file's tree as `Adapter` reads it; files written before the Flax modules hold the flat
    {"attn_norm", "q", "k", "v", "o" (or "qkv"), "out_norm"} and are nested on load."""
    if "attn" in adapter:
        return adapter
    norms = ("attn_norm", "out_norm")
    return {**{n: {"scale": adapter[n]} for n in norms if n in adapter},
            "attn": {k: v for k, v in adapter.items() if k not in norms}}


def adapter_hidden(adapter, x, layer_cache, positions, slots, mask, *, config: ModelConfig):
    """Exit states [B, T, D] through the adapter: (normed states ready for the final norm, layer cache)."""
    x = x.astype(adapter["attn_norm"]["scale"].dtype)
    weights = {k: adapter[k] for k in ("attn_norm", "attn", "out_norm")}  # not a draft vocabulary's ids and rows
    return Adapter(config).apply({"params": weights}, x, layer_cache, positions, slots, mask)


def draft_logits(params, hidden, config: ModelConfig, head=None):
    """The shared final norm and LM head over adapter outputs (`head`: a draft vocabulary's rows of it)."""
    hidden = hidden.astype(params["final_norm"]["scale"].dtype)
    return Decoder(config).apply({"params": params}, hidden, head, method="exit_logits")


@dataclasses.dataclass(frozen=True)
class KangarooDrafter(ChainDrafter):
    """Draft params: the `Adapter`'s {"attn_norm", "attn", "out_norm"}, and a draft vocabulary's
    {"vocab", "head"} if the adapter file has one (`train.draft_vocab`).

    State: {"exit": [B, N, D] exit states by tree node (root = 0), "adapter": the adapter's one-layer
    cache, "length": [B] the committed length the current draft started from}.
    """
    config: ModelConfig
    tree: TreeSpec
    exit_layer: int
    eta: float = 0.6
    process_last_block = True  # the deepest token's exit state and adapter K/V are needed if it is accepted

    def init_state(self, params, draft, cache):
        b = cache[0]["k"].shape[0]
        exits = jax.eval_shape(lambda: self._shallow(params, jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32),
                                                     cache, jnp.zeros((b,), jnp.int32), kv.prompt_chunk(
                                                         jnp.zeros((b,), jnp.int32), 1))[0])
        return {"exit": jnp.zeros((b, self.tree.num_nodes, exits.shape[-1]), exits.dtype),
                "adapter": kv.init_cache(self.config, b, kv.cache_len(cache), **kv.layout(cache))[0],
                "length": jnp.zeros((b,), jnp.int32)}

    def prefill(self, params, draft, state, cache, tokens, start):
        # The target's prefill split at the exit layer: the exit states it passes through feed the adapter, which is
        # all the draft adds to a prompt's time.
        c = tokens.shape[1]
        positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)[None]
        mask = kv.prompt_chunk(start, c)
        exits, cache = self._shallow(params, tokens, positions, cache, start, mask)
        _, layer = adapter_hidden(draft, exits, state["adapter"], positions, start, mask, config=self.config)
        decoder, variables = Decoder(self.config, deep_plan(self.config.num_layers, self.exit_layer)), {"params": params}
        x, cache = decoder.apply(variables, exits, positions, cache, start, mask, method="run_layers")
        return decoder.apply(variables, x, method=lambda m, x: m.final_norm(x)), cache, {**state, "adapter": layer}

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        # `block` learns its tokens' node indices from their slots: slot - length.
        return super().draft(params, draft, cache, length, last, {**state, "length": length}, key, sampling)

    def _shallow(self, params, tokens, positions, cache, slots, mask):
        """Layers 0..l-1 over new tokens: (exit states, cache with their K/V)."""
        decoder, variables = Decoder(self.config, shallow_plan(self.config.num_layers, self.exit_layer)), {"params": params}
        x = decoder.apply(variables, tokens, method="embed_tokens")
        return decoder.apply(variables, x, positions, cache, slots, mask, method="run_layers")

    def _states(self, params, draft, cache, state, tokens, positions, slot, mask):
        """Layers 0..l-1 and the adapter over a block: its exit states and both K/Vs kept, (adapter outputs, cache,
        state)."""
        x, cache = self._shallow(params, tokens, positions, cache, slot, mask)
        exits = kv.put_rows(state["exit"], x, slot - state["length"])
        hidden, layer = adapter_hidden(draft, x, state["adapter"], positions, slot, mask, config=self.config)
        return hidden, cache, {**state, "exit": exits, "adapter": layer}

    def block(self, params, draft, cache, state, tokens, positions, slot, mask):
        # Leaves go through the adapter too: if verification commits one, its adapter K/V must be there.
        hidden, cache, state = self._states(params, draft, cache, state, tokens, positions, slot, mask)
        # The deepest block proposes nothing (`ChainDrafter` drops its logits): skip its head.
        deepest = (slot - state["length"])[0] == self.tree.num_nodes - self.tree.max_rank - 1
        width = draft_vocab.logits_width(draft, self.config.vocab_size)
        logits = jax.lax.cond(deepest, lambda h: jnp.zeros((h.shape[0], width), jnp.float32),
                              lambda h: draft_logits(params, h, self.config, draft.get("head")), hidden[:, 0])
        return logits, cache, state

    def pause(self, params, draft, cache, length, last, state):
        """A step that drafts nothing, the target's own on `last` at slot `length`: the adapter's K/V for `last`,
        from its exit state, as a drafted step's first block writes them. Layers 0..l-1 run again for it (the
        target's step keeps its exit state to itself); their K/V are the step's, so this cache is dropped."""
        positions, mask = length[:, None], kv.causal(length, 1)
        exits, _ = self._shallow(params, last[:, None], positions, cache, length, mask)
        _, layer = adapter_hidden(draft, exits, state["adapter"], positions, length, mask, config=self.config)
        return {**state, "adapter": layer}

    def gave_way(self, params, draft, cache, length, last, nodes, state):
        """Another source drafted the chain: one block over the root and every node (no head) leaves the exit
        states verification reads and the K/V a committed node needs, as drafting them would."""
        tree = self.tree.arrays(last.shape[0])
        tokens = jnp.concatenate([last[:, None], nodes], 1)
        _, cache, state = self._states(params, draft, cache, {**state, "length": length}, tokens,
                                       length[:, None] + tree.depths, length, verify.tree_mask(length, tree))
        return cache, state

    def confident(self, state, probs):
        return jnp.max(probs, axis=-1) > self.eta

    def score(self, params, cache, length, last, nodes, state, tree: TreeArrays):
        """Layers l..L-1 over the nodes' exit states; layers below l already hold their K/V. Nodes left
        undrafted carry stale exit states; they are invalid, so never accepted."""
        positions = length[:, None] + tree.depths
        decoder, variables = Decoder(self.config, deep_plan(self.config.num_layers, self.exit_layer)), {"params": params}
        hidden, cache = decoder.apply(variables, state["exit"][:, :tree.num_nodes], positions, cache, length,
                                      verify.tree_mask(length, tree), method="run_layers")
        return decoder.apply(variables, hidden, method="exit_logits"), cache

    def update(self, state, length, accepted, path, emitted):
        # The adapter K/V of the committed nodes were written while drafting them: move them like the target's.
        layer = verify.commit_path([state["adapter"]], length, path, self.tree.num_nodes, self.chain)[0]
        return {**state, "adapter": layer}


def check_adapter(adapter: dict, config: ModelConfig, path: str) -> dict:
    """The adapter nested as `Adapter` reads it, or a one-line error if it is not one for this model."""
    want = {"o"} | ({"qkv"} if config.arch == "phi3" else {"q", "k", "v"})
    adapter = nest_adapter(adapter) if isinstance(adapter, dict) else adapter
    if not isinstance(adapter, dict) or set(adapter) != {"attn_norm", "attn", "out_norm"} or set(adapter["attn"]) != want:
        raise UserError(f"{path} is not a Kangaroo adapter for a {config.arch} model (expected attn_norm, out_norm "
                        f"and attention weights {sorted(want)})")
    width = adapter["attn_norm"]["scale"].shape[0]
    if width != config.hidden_size or adapter["attn"]["o"].shape[1] != config.hidden_size:
        raise UserError(f"{path} was trained for hidden size {width}, not this model's {config.hidden_size}")
    return adapter


def build(m, ar, opts, dtype: str, measure: bool):
    """`--method kangaroo`: the adapter from --draft (or the model's shipped one), its exit layer, eta."""
    from s3djax.loading import DTYPES
    from s3djax.speculative.draft_params import load_artifact
    from s3djax.speculative.loop import SpecDecoder

    config, path, warnings = m.config, opts.draft_path, []
    if path is None:
        raise UserError(f"{m.name} has no shipped Kangaroo adapter: train one with `python -m train.kangaroo` and "
                        "pass --draft PATH (or --draft none for an untrained one)")
    if path == "none":
        exit_layer = check_exit_layer(opts.exit_layer or default_exit_layer(config.num_layers), config.num_layers)
        adapter, meta = init_adapter(m.params, config, exit_layer), {}
        warnings.append("no trained adapter: using layer {}'s attention untrained, so acceptance will be low"
                        .format(exit_layer))
    else:
        adapter, meta = load_artifact(path, DTYPES[dtype], kind="Kangaroo adapter")
        if meta.get("method") != "kangaroo" or "exit_layer" not in meta:
            raise UserError(f"{path} is not a Kangaroo adapter (train one with `python -m train.kangaroo`)")
        exit_layer = meta["exit_layer"]
        if opts.exit_layer is not None and opts.exit_layer != exit_layer:
            raise UserError(f"{path} was trained for exit layer {exit_layer}, not --exit-layer {opts.exit_layer}: "
                            "an adapter serves only its own exit layer")
        check_exit_layer(exit_layer, config.num_layers)
        adapter = check_adapter(adapter, config, path)
    adapter = draft_vocab.attach(jax.tree.map(lambda a: jnp.asarray(a, DTYPES[dtype]), adapter), meta, m.params)
    adapter = draft_weights.attach(adapter, m.params, opts.draft_weights, DTYPES[dtype], own=("attn",))
    # The adapter file may carry the eta its sweep measured fastest; the paper's 0.6 otherwise.
    eta = opts.eta if opts.eta is not None else meta.get("eta", 0.6)
    if not 0 <= eta <= 1:
        raise UserError(f"--eta must be in [0, 1], got {eta}")
    # Likewise the tree and the deepest draft: the file's measured fastest, else the paper's chain of 6.
    tree, chosen = chosen_spine("kangaroo", m, ar, opts, dtype, measure, meta, 6,
                                 as_recorded=opts.eta is None)
    drafter = KangarooDrafter(config, tree, exit_layer, eta)
    return Built(SpecDecoder.create(ar, drafter), (m.params, adapter), warnings,
                 f"adapter {about_file(path, meta)}, exit layer {exit_layer}, eta {eta}, {about_spine(tree, chosen)}"
                 + draft_vocab.about(meta) + draft_weights.about(adapter, m.params), chosen)
