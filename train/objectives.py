"""The S3D training objective (paper Eq. 9), built to match the inference draft step exactly.

One full-model pass over a sequence gives every layer's context K/V. At each anchor i, the block
[t_i, <M> x (gamma-1)] sits at positions i .. i+gamma-1 and runs through the draft's layers, seeing
context keys < i (never i itself: the block brings its own K/V for t_i, as at inference) and
itself causally, never another block. Depth j of the block predicts t_{i+j}.

Targets: "data" is the paper's cross-entropy on the data tokens; "greedy" and "kl" distil the full
model's own prediction at the same position, which is what greedy verification accepts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from s3djax.config import ModelConfig
from s3djax.model import Decoder, forward_sequence
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.correction import delta

TARGETS = ("data", "greedy", "kl")


def sample_anchors(key, loss_mask, lengths, num_anchors: int):
    """[B, A] anchor positions and their validity: distinct, uniform over positions i >= 1 whose
    next token is trained on (so anchors stay out of template text)."""
    b, t = loss_mask.shape
    pos = jnp.arange(t)
    nxt = jnp.concatenate([loss_mask[:, 1:], jnp.zeros((b, 1), loss_mask.dtype)], axis=1)
    valid = (pos[None] >= 1) & (pos[None] + 1 < lengths[:, None]) & (nxt > 0)
    scores = jnp.where(valid, jax.random.gumbel(key, (b, t)), -jnp.inf)
    _, anchors = jax.lax.top_k(scores, num_anchors)
    return anchors.astype(jnp.int32), jnp.take_along_axis(valid, anchors, axis=1)


def block_mask(anchors, context_len: int, gamma: int):
    """[B, A*gamma, context_len + A*gamma]: context keys < anchor, then the own block causally."""
    b, a = anchors.shape
    ctx = jnp.arange(context_len)[None, None, :] < anchors[:, :, None]                       # [B, A, T]
    ctx = jnp.repeat(ctx, gamma, axis=1)                                                    # [B, A*g, T]
    q = jnp.arange(a * gamma)
    own = (q[:, None] // gamma == q[None, :] // gamma) & (q[None, :] <= q[:, None])          # [A*g, A*g]
    return jnp.concatenate([ctx, jnp.broadcast_to(own, (b, a * gamma, a * gamma))], axis=2)


def block_logits(params, draft, context_cache, tokens, anchors, *, config: ModelConfig, plan: SkipPlan, gamma: int):
    """Draft logits [B, A, gamma, V] of every anchor's block, all blocks in one forward."""
    b, t = tokens.shape
    a = anchors.shape[1]
    decoder, variables = Decoder(config, plan), {"params": params}
    first = decoder.apply(variables, jnp.take_along_axis(tokens, anchors, axis=1), method="embed_tokens")  # [B, A, D]
    rest = jnp.broadcast_to(draft["mask_embed"].astype(first.dtype), (b, a, gamma - 1, first.shape[-1]))
    embeds = jnp.concatenate([first[:, :, None], rest], axis=2).reshape(b, a * gamma, -1)
    positions = (anchors[:, :, None] + jnp.arange(gamma)[None, None]).reshape(b, a * gamma)
    pad = ((0, 0), (0, a * gamma), (0, 0), (0, 0))
    cache = [{"k": jnp.pad(c["k"], pad), "v": jnp.pad(c["v"], pad)} for c in context_cache]
    hidden, _ = decoder.apply(variables, None, positions, cache, jnp.full((b,), t, jnp.int32),
                              block_mask(anchors, t, gamma), embeds=embeds, lora=draft.get("lora"))
    if "correction" in draft:  # teacher-forced: mask position j's previous token is the data's t_{i+j}
        previous = jnp.take_along_axis(tokens, jnp.minimum(positions, t - 1), axis=1)
        masks = (jnp.arange(a * gamma) % gamma > 0)[None, :, None]
        hidden = hidden + masks * delta(draft["correction"], hidden,
                                        decoder.apply(variables, previous, method="embed_tokens"))
    return decoder.apply(variables, hidden, method="logits").reshape(b, a, gamma, -1)


def _cross_entropy(logits, labels):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]


def s3d_loss(params, draft, batch, key, *, config: ModelConfig, plan: SkipPlan, gamma: int, num_anchors: int,
             target: str = "data", lm_weight: float = 0.0):
    """(loss, sums): the mean block loss over trained (anchor, depth) pairs, plus lm_weight times the
    full model's next-token loss (full mode keeps the target good with it).

    `sums` holds per-depth totals (loss, draft top-1 agreement with the full model's greedy token,
    count) so that gradient accumulation and devices add up exactly.
    """
    tokens, loss_mask, lengths = batch["tokens"], batch["loss_mask"], batch["lengths"]
    hidden, context_cache = forward_sequence(params, tokens, config=config)
    logits = lambda h: Decoder(config).apply({"params": params}, h, method="logits")
    anchors, valid = sample_anchors(key, loss_mask, lengths, num_anchors)
    draft_logits = block_logits(params, draft, context_cache, tokens, anchors, config=config, plan=plan, gamma=gamma)

    at = anchors[:, :, None] + jnp.arange(gamma)[None, None]                                 # [B, A, g]: predicts at+1
    b, t = tokens.shape
    # Blocks near the end run past the data; those depths get weight 0, and indices are clamped
    # because an out-of-range gather fills floats with NaN, which a 0 weight does not cancel.
    index = lambda shift: jnp.minimum(at + shift, t - 1).reshape(b, -1)
    gather = lambda x: jnp.take_along_axis(x, index(1), axis=1).reshape(at.shape)
    weight = (valid[:, :, None] & (at + 1 < lengths[:, None, None]) & (gather(loss_mask) > 0)).astype(jnp.float32)
    full_logits = jax.lax.stop_gradient(
        logits(jnp.take_along_axis(hidden, index(0)[..., None], axis=1)).reshape(draft_logits.shape))
    greedy = jnp.argmax(full_logits, axis=-1)
    if target == "data":
        per = _cross_entropy(draft_logits, gather(tokens))
    elif target == "greedy":
        per = _cross_entropy(draft_logits, greedy)
    elif target == "kl":
        # KL(p || q) = sum p log p + logsumexp(z) - sum p z: no log q term, so no 0 * -inf anywhere.
        p = jax.nn.softmax(full_logits)
        entropy = jnp.sum(jnp.where(p > 0, p * jax.nn.log_softmax(full_logits), 0.0), axis=-1)
        per = entropy + jax.nn.logsumexp(draft_logits, axis=-1) - jnp.sum(p * draft_logits, axis=-1)
    else:
        raise ValueError(f"unknown target {target!r}; choose from {TARGETS}")

    sums = {"depth_loss": jnp.sum(per * weight, axis=(0, 1)),
            "depth_correct": jnp.sum((jnp.argmax(draft_logits, axis=-1) == greedy) * weight, axis=(0, 1)),
            "depth_count": jnp.sum(weight, axis=(0, 1))}
    loss = jnp.sum(sums["depth_loss"]) / jnp.maximum(jnp.sum(sums["depth_count"]), 1.0)
    if lm_weight:
        lm_mask = (loss_mask[:, 1:] > 0) & (jnp.arange(1, t)[None] < lengths[:, None])
        lm = _cross_entropy(logits(hidden[:, :-1]), tokens[:, 1:])
        sums["lm_loss"] = jnp.sum(lm * lm_mask)
        sums["lm_count"] = jnp.sum(lm_mask).astype(jnp.float32)
        loss = loss + lm_weight * sums["lm_loss"] / jnp.maximum(sums["lm_count"], 1.0)
    return loss, sums
