"""Turning logits into the next token: greedy, or temperature with top-k / top-p, on device.

Nothing here sorts the vocabulary. Top-p's cut is found among the largest `CANDIDATES` logits (one
`lax.top_k`), which decides it exactly whenever the nucleus lies inside them; only where a nucleus is
wider is the cut searched for over the whole row, by halving. A token is drawn by inverse CDF with
one uniform per row, where `jax.random.categorical` draws a Gumbel per vocabulary entry.
docs/sampling.md has the measurements.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

# How many of the largest logits top-p's threshold is searched among before the whole row is. Any value is exact;
# it only bounds the common path's work (a top-k of 256 costs about what 16 of the vocabulary's exps do).
CANDIDATES = 256


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are drawn, passed whole (`Generator.generate(..., sampling=Sampling(0.7, top_p=0.9))`): every
    method samples exactly the target's distribution under it. Bad values are one-line `UserError`s."""
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
        """Temperature 0: the argmax, and speculative output token-identical to `ar`'s."""
        return self.temperature == 0.0


GREEDY = Sampling()  # the default everywhere: temperature 0


def top_k(x, k: int):
    """`jax.lax.top_k`, kept apart from what reads it: XLA:CPU turns a top-k whose outputs feed other ops in
    the same fusion scope into a full stable sort (17 ms against 0.1 ms for 32 of [4, 8192] on a 2-core
    Zen 3), and the barrier keeps its fast path."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def process_logits(logits, s: Sampling):
    """Temperature-scaled logits with the top-k / top-p tails set to -inf (the target distribution).

    Top-k keeps every token at least as large as the k-th largest; top-p then keeps the smallest
    prefix of the descending order whose mass reaches top_p (a token is cut when the mass before it
    already does), and every token tied with that prefix's last.
    """
    logits = logits.astype(jnp.float32) / s.temperature
    v = logits.shape[-1]
    cut_k = 0 < s.top_k < v  # a top-k as wide as the logits cuts nothing
    if not cut_k and s.top_p == 1.0:
        return logits
    # Top-k alone needs only its own k; top-p searches the candidates.
    largest = top_k(logits, min(v, s.top_k if s.top_p == 1.0 else max(CANDIDATES, s.top_k)))[0]  # descending
    if cut_k:
        kth = largest[..., s.top_k - 1:s.top_k]
        logits, largest = (jnp.where(x < kth, -jnp.inf, x) for x in (logits, largest))
    if s.top_p < 1.0:
        def threshold(order, probs):
            """The nucleus's smallest logit, and whether `order` (a descending prefix) reached its cut."""
            cut = (jnp.cumsum(probs, axis=-1) - probs) >= s.top_p
            return jnp.min(jnp.where(cut, jnp.inf, order), axis=-1, keepdims=True), jnp.any(cut, axis=-1)

        if largest.shape[-1] < v:
            # The candidates' probabilities share the full sort's numerators and prefix sums; only the normalizer is
            # summed in another order, which can move the cut where the mass before a token is within rounding of
            # top_p (tests/test_sampling.py).
            peak = largest[..., :1]
            probs = jnp.exp(largest - peak) / jnp.sum(jnp.exp(logits - peak), -1, keepdims=True)
            inside, found = threshold(largest, probs)
            inside = jax.lax.cond(jnp.all(found), lambda: inside, lambda: bisected_threshold(logits, s.top_p))
        else:  # the candidates are the whole sorted vocabulary
            inside = threshold(largest, jax.nn.softmax(largest, axis=-1))[0]
        logits = jnp.where(logits < inside, -jnp.inf, logits)
    return logits


def _order_key(x):
    """uint32 keys in the order of the float32s x (-0.0 taken as +0.0, as a comparison takes it)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def bisected_threshold(logits, top_p: float):
    """Top-p's threshold [..., 1] without a sort: the smallest logit whose strictly larger ones hold less than top_p of
    the mass, which is the nucleus's smallest logit, ties kept. The mass above a value falls as the value rises, so
    32 halvings of the floats' order find it, each one masked sum over the row, at a fraction of a sort's cost
    (docs/sampling.md). The normalizer is summed in another order than the sorted one, with
    the same consequence as the candidates' (`process_logits`)."""
    keys = _order_key(logits)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    goal = top_p * jnp.sum(weights, axis=-1, keepdims=True)

    def halve(_, bounds):  # the mass above lo reaches the goal, that above hi does not
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = jnp.sum(jnp.where(keys > mid, weights, 0.0), axis=-1, keepdims=True) < goal
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    lo = jnp.zeros(goal.shape, jnp.uint32)
    hi = jnp.max(keys, axis=-1, keepdims=True)
    hi = jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]
    return jnp.min(jnp.where(keys >= hi, logits, jnp.inf), axis=-1, keepdims=True)


def process_logits_reference(logits, s: Sampling):
    """`process_logits` by its definition, as it was computed before the candidates: top-k by `top_k`, top-p by a
    full descending sort of the vocabulary. Tests and benchmarks.research.sampling_cost compare the two."""
    logits = logits.astype(jnp.float32) / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        order = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(order, axis=-1)
        cut = (jnp.cumsum(probs, axis=-1) - probs) >= s.top_p
        threshold = jnp.min(jnp.where(cut, jnp.inf, order), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def draw(key, logits):
    """One index per row [...] from softmax(logits [..., V]) (entries of -inf never drawn)."""
    return _inverse_cdf(key, _blocked(logits, -jnp.inf, jnp.exp))


def draw_from_probs(key, probs):
    """One index per row [...] from unnormalized probabilities [..., V] (zeros never drawn)."""
    return _inverse_cdf(key, _blocked(probs, 0.0, None))


def _blocked(x, fill, to_weights):
    """[..., V] -> non-negative weights [..., n, width], padded with zero weight: about sqrt(V) blocks of sqrt(V)."""
    v = x.shape[-1]
    width = math.isqrt(v - 1) + 1
    n = -(-v // width)
    x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, n * width - v)], constant_values=fill)
    if to_weights is not None:
        x = to_weights(x - jnp.max(x, axis=-1, keepdims=True))
    return x.reshape(*x.shape[:-1], n, width)


def _inverse_cdf(key, weights):
    """The index of weights [..., n, width] where one uniform draw falls in their running sum: the block by the
    blocks' running sum, then the entry by the block's own. Both searches take the first sum above the target,
    and the target is kept below the last sum, so the entry drawn has positive weight however the sums round."""
    n, width = weights.shape[-2:]
    blocks = jnp.cumsum(jnp.sum(weights, -1), -1)                                      # [..., n]
    total = blocks[..., -1]
    target = jnp.minimum(jax.random.uniform(key, total.shape) * total, jnp.nextafter(total, 0.0))
    block = jnp.sum(blocks <= target[..., None], -1)
    before = jnp.where(block > 0, jnp.take_along_axis(blocks, jnp.maximum(block - 1, 0)[..., None], -1)[..., 0], 0.0)
    inner = jnp.cumsum(jnp.take_along_axis(weights, block[..., None, None], -2)[..., 0, :], -1)  # [..., width]
    rest = jnp.clip(target - before, 0.0, jnp.nextafter(inner[..., -1], 0.0))
    return (block * width + jnp.sum(inner <= rest[..., None], -1)).astype(jnp.int32)


def draws(key, logq, k: int):
    """k draws without replacement from softmax(logq [..., V]), in the order drawn: (their scores, indices) [..., k].
    A score is -inf where q had fewer than k tokens to give. One draw is `draw`'s; more are Gumbel-top-k
    (Kool et al. 2019): the k best of log q + Gumbel noise are k draws from q one after another."""
    if k == 1:
        index = draw(key, logq)[..., None]
        return jnp.take_along_axis(logq, index, -1), index
    return top_k(logq + jax.random.gumbel(key, logq.shape), k)


def sample(logits, key, s: Sampling):
    """[..., V] logits -> [...] int32 tokens."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draw(key, process_logits(logits, s))
