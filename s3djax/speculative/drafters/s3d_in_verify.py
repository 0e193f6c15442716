"""S3D drafting inside the verify pass: no draft step of its own after the first.

The verify forward runs the root and a chain of gamma drafts through the full target, as always, and
beside each of those gamma + 1 anchors a branch that is a draft block: the anchor's token again in the
anchor's place, then gamma mask tokens, every row running the draft's plan and adapters
(`model.DraftRows`). The chain never attends to a branch, so its logits are exactly verification's. A
branch sees the committed prefix and the chain above its anchor through the target's K/V, as a draft
block sees the committed cache, and its masks predict the gamma tokens after the token that follows
the anchor. Verification keeps the deepest accepted anchor and emits that following token itself (the
bonus), so that anchor's branch has drafted the next step's chain.

A step then costs one forward over (gamma + 1)(gamma + 2) tokens instead of a draft over gamma and a
verify over gamma + 1, and the chain's first draft is a mask token's (a block's depth 2) rather than
the block's own first position. The first step has no branch behind it: its chain is all invalid, so
it commits the bonus token alone, and no step ever branches on whether to draft (a conditional would
copy the K/V cache on a GPU). Measured: docs/methods.md#drafting-inside-the-verify-pass.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s3djax.cache import PrefixTreeMask
from s3djax.model import Decoder, DraftRows
from s3djax.sampling import Sampling
from s3djax.speculative import verify
from s3djax.speculative.drafters.s3d import S3DDrafter
from s3djax.speculative.tree import ancestor_matrix


@dataclasses.dataclass(frozen=True)
class InVerifyS3DDrafter(S3DDrafter):
    pause = None  # a step's chain comes from the verify pass before it
    """S3D on a chain of gamma whose verify forward drafts the next chain. State: the next chain's {"nodes"
    [B, gamma], "valid", "q" [B, gamma + 1, V] (sampling's child_probs, root first)}."""

    @functools.cached_property
    def layout(self):
        """(depths [N], ancestors [N, N], draft-row flags [N]) of the verify forward: root, chain, then each
        anchor's branch (root first): the anchor's token again as a draft row in its place, and the masks."""
        k = self.gamma
        parents = [0] + list(range(k))  # the root is its own parent; chain node d's is d - 1
        depths = list(range(k + 1))
        for anchor in range(k + 1):
            parents.append(anchor - 1 if anchor else len(parents))  # the root's copy: a parent of its own, no ancestor
            depths.append(anchor)
            for j in range(k):
                parents.append(len(parents) - 1)
                depths.append(anchor + j + 1)
        flags = tuple(i > k for i in range(len(parents)))
        return np.asarray(depths, np.int32), ancestor_matrix(np.asarray(parents)), flags

    @property
    def scratch_nodes(self) -> int:
        return len(self.layout[0])

    def init_state(self, params, draft, cache):
        b, k = cache[0]["k"].shape[0], self.gamma
        return {"nodes": jnp.zeros((b, k), jnp.int32), "valid": jnp.zeros((b, k), bool),
                "q": jnp.zeros((b, k + 1, self.config.vocab_size), jnp.float32)}

    def resume(self, state):
        # The chain the last verify drafted continues the old text, not the new turn: the first step drafts nothing.
        return {**state, "valid": jnp.zeros_like(state["valid"])}

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        return state["nodes"], state["valid"], None if sampling.greedy else state["q"], cache, state

    def forward(self, params, draft, cache, length, last, nodes):
        """The target's logits [B, gamma + 1, V] on the root and chain, every branch's final-normed states
        [B, gamma + 1 (anchor), gamma, D], and the cache with every row's K/V in its scratch slot."""
        b, k = last.shape[0], self.gamma
        depths, ancestors, flags = self.layout
        decoder, variables = Decoder(self.config), {"params": params}
        chain = decoder.apply(variables, jnp.concatenate([last[:, None], nodes], 1), method="embed_tokens")
        masks = jnp.broadcast_to(draft["mask_embed"].astype(chain.dtype), (b, k + 1, k, chain.shape[-1]))
        branches = jnp.concatenate([chain[:, :, None], masks], 2).reshape(b, (k + 1) ** 2, -1)
        hidden, cache = decoder.apply(
            variables, None, length[:, None] + depths, cache, length,
            PrefixTreeMask(length, jnp.broadcast_to(ancestors, (b,) + ancestors.shape)),
            embeds=jnp.concatenate([chain, branches], 1), lora=draft.get("lora"), rows=DraftRows(self.plan, flags))
        logits = decoder.apply(variables, hidden[:, :k + 1], method="logits")
        return logits, hidden[:, k + 1:].reshape(b, k + 1, k + 1, -1)[:, :, 1:], cache

    def verify(self, params, draft, cache, length, last, nodes, valid, child_probs, state, key, sampling: Sampling):
        b = last.shape[0]
        logits, branches, cache = self.forward(params, draft, cache, length, last, nodes)
        draw_key = None
        if not sampling.greedy:
            key, draw_key = jax.random.split(key)
        cache, accepted, emitted, path = verify.settle(logits, cache, length, last, nodes, valid,
                                                       tree=self.tree.arrays(b), sampling=sampling,
                                                       child_probs=child_probs, key=key, chain=self.chain)
        # The branch of the deepest accepted anchor drafted the k tokens after the bonus token, which a previous-token
        # correction now knows.
        rows = jnp.arange(b)
        nodes, valid, q, _ = self.propose(params, draft, branches[rows, accepted], emitted[rows, accepted], (),
                                          draw_key, sampling, from_masks=True)
        state = {"nodes": nodes, "valid": valid, "q": state["q"] if q is None else q.astype(state["q"].dtype)}
        return cache, accepted, emitted, path, state
