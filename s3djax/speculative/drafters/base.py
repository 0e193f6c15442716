"""The drafter defaults: no state of its own, verification by the whole target."""

from __future__ import annotations

from s3djax.sampling import Sampling
from s3djax.speculative import verify
from s3djax.speculative.tree import TreeArrays


class Drafter:
    # `gave_way(params, draft, cache, length, last, nodes, state) -> (cache, state)`, where a drafter has work to do
    # at a step whose chain another source drafted (`WithLookup`): its caches and state as if it had drafted `nodes`.
    gave_way = None
    # `pause(params, draft, cache, length, last, state) -> state`, where a drafter keeps its state through a step that
    # drafts nothing (the target's own step on `last` at slot `length`); None where it cannot, and then every step
    # drafts (the loop's pause gate, `s3djax.speculative.loop`).
    pause = None

    def unchanged(self, params, draft, cache, length, last, state):
        """`pause` for a drafter whose state a step without a draft leaves as it is."""
        return state

    @property
    def scratch_nodes(self) -> int:
        """Cache slots a step writes past the committed length: the draft block's or the tree's."""
        return max(self.tree.num_nodes, self.gamma)

    def init_state(self, params, draft, prompt, lengths, cache):
        return ()

    def stats(self, state) -> dict:
        """What the drafter counted over a run, from its final state."""
        return {}

    def tree_arrays(self, state, batch: int):
        """The tree this step drafted: a static tree's constants (a dynamic tree's drafter overrides this)."""
        return self.tree.arrays(batch)

    def score(self, params, cache, length, last, nodes, state, tree: TreeArrays):
        """The target's logits [B, N, V] at every node of `tree`, and the cache with every node's K/V in its
        scratch slot."""
        return verify.score(params, cache, length, last, nodes, config=self.config, tree=tree)

    def verify(self, params, draft, cache, length, last, nodes, valid, child_probs, state, key, sampling: Sampling):
        tree = self.tree_arrays(state, last.shape[0])
        logits, cache = self.score(params, cache, length, last, nodes, state, tree)
        return (*verify.settle(logits, cache, length, last, nodes, valid, tree=tree, sampling=sampling,
                               child_probs=child_probs, key=key), state)

    def update(self, state, length, accepted, path, emitted):
        return state
