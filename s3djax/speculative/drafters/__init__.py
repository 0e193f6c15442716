"""Drafters: each proposes the tokens of a static tree's nodes; accept and commit are shared.

The interface (every drafter is a frozen dataclass, so it is a static jit argument; `Drafter` has
the defaults):
- `tree`: the static TreeSpec it fills, and `gamma`, how many positions ahead it looks;
- `init_state(params, draft, cache)`: the drafter's own loop state (thresholds, its own caches), a pytree,
  before any prompt; `extend(params, draft, state, tokens, start, cache)` takes it past each chunk of prompt
  the target prefilled into `cache`, and `resume(state)` readies a finished run's state for a continued
  text (a chat's next turn);
- `draft(params, draft, cache, length, last, state, key, sampling) -> (node_tokens [B, N-1], valid [B, N-1],
  child_probs, cache, state)`: propose tokens for the tree's non-root nodes. `valid` masks nodes left
  unproposed (adaptive draft lengths are masked, never recompiled). Writes into cache slots >= length
  are scratch: verify overwrites them. Greedy: `child_probs` is None and `key` unused. Sampling: each
  node's children must be draws from a distribution q, in rank order and without replacement, and
  `child_probs` [B, N, V] gives each node's q (root included), which lossless acceptance needs;
- `verify(params, draft, cache, length, last, nodes, valid, child_probs, state, key, sampling)
  -> (cache, accepted [B], emitted [B, D+1], path [B, D+1], state)`: the full target's verdict, by
  default one forward over the whole tree (Kangaroo reuses its shallow layers' work instead);
- `update(state, length, accepted, path, emitted) -> state`: learn from the verdict, and move
  drafter-owned caches' accepted entries the way the target's cache was (`verify.commit_path`).
"""
