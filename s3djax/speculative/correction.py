"""S3D's previous-token correction: a mask position learns which token the depth before it drafted.

Drafting all depths in one forward, a mask token never sees the token drafted just before it, which is
what caps depth 2 and beyond. The correction adds a low-rank term of (the position's final-normed
state, the embedding of the previous depth's token) to that state, at every mask position (depth 1's
position already holds its previous token, the last one, as input). The LM head is linear in it, so a
node's children are its depth's own top candidates rescored, `logits + head . delta`: a few dot products
per node, never another pass over the head or the layers.

It is trained teacher-forced (the previous token is the verifier's), which is exactly the condition
under which a depth's draft can count: its path was accepted up to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Candidates per position that the correction rescores: the uncorrected logits' top 32.
CANDIDATES = 32


def init_correction(hidden: int, rank: int, key, dtype=jnp.float32) -> dict:
    """The output projection starts at 0, so a fresh correction changes nothing."""
    k_state, k_token = jax.random.split(key)
    scale = 1.0 / np.sqrt(hidden)
    return {"state": (jax.random.normal(k_state, (hidden, rank)) * scale).astype(dtype),
            "token": (jax.random.normal(k_token, (hidden, rank)) * scale).astype(dtype),
            "out": jnp.zeros((rank, hidden), dtype)}


def delta(correction: dict, states, token_embeds):
    """[..., D]: what the correction adds to final-normed `states` given the previous tokens' embeddings."""
    # Embedding rows are far shorter than final-normed states (3 against 43 on SmolLM2): normed, the token's
    # term starts as loud as the state's.
    e = token_embeds.astype(jnp.float32)
    e = (e * jax.lax.rsqrt(jnp.mean(e * e, axis=-1, keepdims=True) + 1e-6)).astype(states.dtype)
    u = states @ correction["state"].astype(states.dtype) + e @ correction["token"].astype(states.dtype)
    return jax.nn.silu(u) @ correction["out"].astype(states.dtype)
