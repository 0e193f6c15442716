"""Turning logits into the next token: greedy, or temperature with top-k / top-p, on device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1: off

    def __post_init__(self):
        from s3djax.errors import UserError

        for name, ok in (("temperature", self.temperature >= 0), ("top-k", self.top_k >= 0),
                         ("top-p", 0 < self.top_p <= 1)):
            if not ok:
                raise UserError(f"--{name} must be {'in (0, 1]' if name == 'top-p' else '>= 0'}, "
                                f"got {getattr(self, name.replace('-', '_'))}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k(x, k: int):
    """`jax.lax.top_k`, kept apart from what reads it: XLA:CPU turns a top-k whose outputs feed other ops in
    the same fusion scope into a full stable sort (17 ms against 0.1 ms for 32 of [4, 8192] on a 2-core
    Zen 3), and the barrier keeps its fast path."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def process_logits(logits, s: Sampling):
    """Temperature-scaled logits with the top-k / top-p tails set to -inf (the target distribution)."""
    logits = logits.astype(jnp.float32) / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:  # a top-k as wide as the logits cuts nothing
        kth = top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        order = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is cut when the mass before it already does.
        cut = (jnp.cumsum(probs, axis=-1) - probs) >= s.top_p
        threshold = jnp.min(jnp.where(cut, jnp.inf, order), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample(logits, key, s: Sampling):
    """[..., V] logits -> [...] int32 tokens."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, s), axis=-1).astype(jnp.int32)
