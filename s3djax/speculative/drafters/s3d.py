"""S3D: one forward of the skip-plan model over [last token, <M> x (gamma-1)] drafts gamma positions.

A draft with its own vocabulary (`s3djax.speculative.draft_vocab`) drafts over those tokens only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from s3djax import cache as kv
from s3djax import quant
from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.sampling import Sampling, process_logits
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.tree import TreeSpec


@dataclasses.dataclass(frozen=True)
class S3DDrafter(Drafter):
    config: ModelConfig
    plan: SkipPlan
    tree: TreeSpec
    gamma: int

    def block_logits(self, params, draft, cache, length, last):
        """Logits [B, gamma, V] for positions length+1 .. length+gamma, and the cache with scratch writes.

        The block sits at positions and slots length .. length+gamma-1: it sees the committed cache
        (slots < length) and itself causally, at every layer the plan keeps.
        """
        b = last.shape[0]
        decoder, variables = Decoder(self.config, self.plan), {"params": params}
        first = decoder.apply(variables, last, method="embed_tokens")[:, None]
        masks = jnp.broadcast_to(draft["mask_embed"].astype(first.dtype), (b, self.gamma - 1, first.shape[-1]))
        positions = length[:, None] + jnp.arange(self.gamma, dtype=jnp.int32)[None]
        mask = kv.causal(length, self.gamma)
        hidden, cache = decoder.apply(variables, None, positions, cache, length, mask,
                                      embeds=jnp.concatenate([first, masks], axis=1), lora=draft.get("lora"))
        if draft_vocab.has_vocab(draft):
            return quant.head(hidden, draft["head"]), cache
        return decoder.apply(variables, hidden, method="logits"), cache

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        logits, cache = self.block_logits(params, draft, cache, length, last)
        # Simultaneous drafting: a node's candidates depend on its depth only, not on its parent.
        at = (slice(None), self.tree.node_depths[1:] - 1, self.tree.node_ranks[1:])
        k = self.tree.max_rank + 1
        if sampling.greedy:
            best = jnp.argmax(logits, axis=-1)[..., None] if k == 1 else jax.lax.top_k(logits, k)[1]
            nodes = draft_vocab.token_ids(draft, best[at]).astype(jnp.int32)
            return nodes, jnp.ones(nodes.shape, bool), None, cache, state
        logq = jax.nn.log_softmax(process_logits(logits, sampling), axis=-1)             # [B, gamma, V_draft]
        # Gumbel-top-k: the k best of log q + Gumbel noise are k draws from q one after another
        # without replacement (Kool et al. 2019), the order sampled verification tries them in.
        scores, candidates = jax.lax.top_k(logq + jax.random.gumbel(key, logq.shape), k)
        nodes, valid = draft_vocab.token_ids(draft, candidates[at]).astype(jnp.int32), jnp.isfinite(scores[at])  # q(x) = 0 is no draw
        q = jnp.exp(logq)[:, np.minimum(self.tree.node_depths, self.gamma - 1)]         # node -> q of depth + 1
        q = draft_vocab.full_probs(draft, q, self.config.vocab_size)
        return nodes, valid, q, cache, state
