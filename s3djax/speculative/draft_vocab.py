"""A draft's own vocabulary: token ids in the draft file (`train.draft_vocab`) and their rows of the LM head.

The draft scores only those rows, which for SmolLM2's tied 49k-row head is most of a shallow draft's
work. Lossless all the same: verification keeps the full head, and a token outside the vocabulary is
simply never drafted. The draft params then carry "vocab" [V_draft] int32 and "head" [V_draft, D].
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from s3djax import quant
from s3djax.errors import UserError


def attach(draft: dict, meta: dict, params) -> dict:
    """The draft with its vocabulary's ids and head rows (taken once, at build time), if its file has one."""
    if not meta.get("vocab"):
        return draft
    table = params.get("lm_head", params["embed"])
    ids = np.asarray(meta["vocab"])
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= table.shape[0]:
        raise UserError(f"the draft vocabulary must be token ids in 0..{table.shape[0] - 1}")
    ids = jnp.asarray(ids, jnp.int32)
    return {**draft, "vocab": ids, "head": quant.rows(table, ids)}


def about(meta: dict) -> str:
    return f", vocabulary {len(meta['vocab'])}" if meta.get("vocab") else ""


def token_ids(draft, index):
    """Token ids of indices into the draft's logits."""
    return jnp.take(draft["vocab"], index) if has_vocab(draft) else index


def full_probs(draft, q, vocab_size: int):
    """q [..., V_draft] spread over the whole vocabulary, zero outside the draft's."""
    if not has_vocab(draft):
        return q
    return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., draft["vocab"]].set(q)


def logits_width(draft, vocab_size: int) -> int:
    """How many logits the draft scores: its vocabulary's size, else the whole vocabulary."""
    return draft["head"].shape[0] if has_vocab(draft) else vocab_size


def has_vocab(draft) -> bool:
    return isinstance(draft, dict) and "vocab" in draft
