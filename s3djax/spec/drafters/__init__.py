"""Drafters: each proposes the tokens of a static tree's nodes; verify, accept and commit are shared.

The interface (duck-typed; every drafter is a frozen dataclass, so it is a static jit argument):
- `tree`: the static TreeSpec it fills, and `gamma`, how many positions ahead it looks;
- `init_state(params, draft)`: the drafter's own loop state (thresholds, adapter caches), a pytree;
- `draft(params, draft, cache, length, last, state, key, sampling) -> (node_tokens [B, N-1], valid [B, N-1],
  child_probs, cache, state)`: propose tokens for the tree's non-root nodes. `valid` masks nodes left
  unproposed (adaptive draft lengths are masked, never recompiled). Writes into cache slots >= length
  are scratch: verify overwrites them. Greedy: `child_probs` is None and `key` unused. Sampling: each
  node's children must be draws from a distribution q, in rank order and without replacement, and
  `child_probs` [B, N, V] gives each node's q (root included), which lossless acceptance needs;
- `update(state, accepted [B]) -> state`: learn from how many drafted tokens verify accepted.
"""
