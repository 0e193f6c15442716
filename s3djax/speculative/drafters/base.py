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
    # `hint(state, length, token) -> [B] bool`, where a drafter knows for free, after a paused step that put `token` at
    # slot `length` + 1, whether the draft it would have made there began with that token: its first draft would have
    # been accepted (with the target's own probability of it, when sampling). The gate then drafts on such a hit
    # instead of probing blindly. None: it probes.
    hint = None
    # `free(state, length, last) -> [B] bool`, where some steps' drafts run no model (`WithLookup`, where prompt lookup
    # drafts the chain): such a step costs its verify alone, so the pause gate weighs it against a breakeven of its
    # own (`s3djax.speculative.gate`). None: every step that drafts costs the same.
    free = None
    # `force(state, free: bool) -> state`, with `free`: the gate's measurement makes every step draft by the model
    # (False), or freely wherever it can (True).
    force = None
    # `prefill(params, draft, state, cache, tokens, start) -> (final-normed hidden [B, C, D], cache, state)`, where a
    # drafter's state after a chunk of prompt comes from the target's own work on it (Kangaroo's exit states): the
    # target's prefill of the chunk and `extend` in one pass. None: the target prefills, then `extend`.
    prefill = None

    def unchanged(self, params, draft, cache, length, last, state):
        """`pause` for a drafter whose state a step without a draft leaves as it is."""
        return state

    @property
    def chain(self) -> bool:
        """Whether every step drafts one chain (a static tree of width 1): verification then moves no K/V."""
        return getattr(self.tree, "spine_width", None) == 1

    @property
    def scratch_nodes(self) -> int:
        """Cache slots a step writes past the committed length: the draft block's or the tree's."""
        return max(self.tree.num_nodes, self.gamma)

    def init_state(self, params, draft, cache):
        """The drafter's own loop state before any prompt (thresholds, its own caches)."""
        return ()

    def extend(self, params, draft, state, tokens, start, cache):
        """The state after a chunk of prompt, tokens [B, C] at slots start [B], whose target K/V `cache` holds."""
        return state

    def resume(self, state):
        """A finished run's state, for a prefill that continues its text (a chat's next turn): what the run counted,
        and drafts made for its next step, reset."""
        return state

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
                               child_probs=child_probs, key=key, chain=self.chain), state)

    def update(self, state, length, accepted, path, emitted):
        return state
