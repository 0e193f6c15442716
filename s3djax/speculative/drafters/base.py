"""The drafter defaults: no state of its own, verification by the whole target."""

from __future__ import annotations

from s3djax.sampling import Sampling
from s3djax.speculative.verify import verify


class Drafter:
    def init_state(self, params, draft, prompt, lengths, cache):
        return ()

    def tree_arrays(self, state, batch: int):
        """The tree this step drafted: a static tree's constants (a dynamic tree's drafter overrides this)."""
        return self.tree.arrays(batch)

    def verify(self, params, draft, cache, length, last, nodes, valid, child_probs, state, key, sampling: Sampling):
        cache, accepted, emitted, path = verify(params, cache, length, last, nodes, valid, config=self.config,
                                                tree=self.tree_arrays(state, last.shape[0]), sampling=sampling,
                                                child_probs=child_probs, key=key)
        return cache, accepted, emitted, path, state

    def update(self, state, length, accepted, path, emitted):
        return state
