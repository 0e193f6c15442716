"""S3D: one forward of the skip-plan model over [last token, <M> x (gamma-1)] drafts gamma positions.

Its tree may be static, or dynamic (`DynamicTree`): the best paths by the draft's joint
probabilities, chosen every step. A draft with its own vocabulary (`s3djax.speculative.draft_vocab`)
drafts over those tokens only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.sampling import Sampling, process_logits
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.tree import DynamicTree, TreeSpec


@dataclasses.dataclass(frozen=True)
class S3DDrafter(Drafter):
    config: ModelConfig
    plan: SkipPlan
    tree: TreeSpec | DynamicTree
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
        return decoder.apply(variables, hidden, draft.get("head"), method="logits"), cache

    def init_state(self, params, draft, prompt, lengths, cache):
        # A dynamic tree changes every step: the loop carries the one drafted to its verification.
        return self.tree.arrays(prompt.shape[0]) if self.tree.dynamic else ()

    def tree_arrays(self, state, batch: int):
        return state if self.tree.dynamic else self.tree.arrays(batch)

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        logits, cache = self.block_logits(params, draft, cache, length, last)
        b, k = last.shape[0], self.tree.max_rank + 1
        if sampling.greedy:
            top, candidates = (jnp.max(logits, -1, keepdims=True), jnp.argmax(logits, -1)[..., None]) if k == 1 \
                else jax.lax.top_k(logits, k)
            # log q of the candidates, for a dynamic tree's choice (XLA drops it for a static tree)
            scores = top.astype(jnp.float32) - jax.nn.logsumexp(logits.astype(jnp.float32), -1, keepdims=True)
        else:
            logq = jax.nn.log_softmax(process_logits(logits, sampling), axis=-1)              # [B, gamma, V_draft]
            # Gumbel-top-k: the k best of log q + Gumbel noise are k draws from q one after another
            # without replacement (Kool et al. 2019), the order sampled verification tries them in.
            drawn, candidates = jax.lax.top_k(logq + jax.random.gumbel(key, logq.shape), k)
            # A dynamic tree's shape comes from q, never from the draws: which children a node tries
            # must not depend on what they turn out to be, or the rejection rule stops being exact.
            scores = jax.lax.top_k(logq, k)[0]
        # Simultaneous drafting: a node's candidates depend on its depth only, not on its parent.
        tree, depth, rank = self.tree.layout(scores)
        rows = jnp.arange(b)[:, None]
        nodes = draft_vocab.token_ids(draft, candidates[rows, depth, rank]).astype(jnp.int32)
        state = tree if self.tree.dynamic else state
        if sampling.greedy:
            return nodes, jnp.ones(nodes.shape, bool), None, cache, state
        valid = jnp.isfinite(drawn[rows, depth, rank])  # q(x) = 0 is no draw
        q = jnp.exp(logq)[rows, jnp.minimum(tree.depths, self.gamma - 1)]                  # node -> q of depth + 1
        q = draft_vocab.full_probs(draft, q, self.config.vocab_size)
        return nodes, valid, q, cache, state
