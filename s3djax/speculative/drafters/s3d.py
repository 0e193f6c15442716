"""S3D: one forward of the skip-plan model over [last token, <M> x (gamma-1)] drafts gamma positions.

Its tree may be static, or dynamic (`DynamicTree`): the best paths by the draft's joint
probabilities, chosen every step. A draft with its own vocabulary (`s3djax.speculative.draft_vocab`)
drafts over those tokens only, and one with int8 weights (`s3djax.speculative.draft_weights`) reads
them. A draft with a previous-token correction
(`s3djax.speculative.correction`) drafts a static tree depth by depth, each node's children
conditioned on its token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from s3djax import cache as kv
from s3djax import defaults, quant
from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.sampling import Sampling, draws, process_logits, top_k
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab, draft_weights
from s3djax.speculative.correction import CANDIDATES, delta
from s3djax.speculative.drafters.base import Drafter
from s3djax.speculative.tree import DynamicTree, TreeSpec


@dataclasses.dataclass(frozen=True)
class S3DDrafter(Drafter):
    pause = Drafter.unchanged  # it drafts from the target's cache and keeps no state between steps
    config: ModelConfig
    plan: SkipPlan
    tree: TreeSpec | DynamicTree
    gamma: int

    def block_hidden(self, params, draft, cache, length, last):
        """Final-normed states [B, gamma, D] for positions length+1 .. length+gamma, and the cache with
        scratch writes.

        The block sits at positions and slots length .. length+gamma-1: it sees the committed cache
        (slots < length) and itself causally, at every layer the plan keeps.
        """
        b = last.shape[0]
        decoder, variables = Decoder(self.config, self.plan), {"params": draft_weights.of(params, draft)}
        first = decoder.apply(variables, last, method="embed_tokens")[:, None]
        masks = jnp.broadcast_to(draft["mask_embed"].astype(first.dtype), (b, self.gamma - 1, first.shape[-1]))
        positions = length[:, None] + jnp.arange(self.gamma, dtype=jnp.int32)[None]
        mask = kv.causal(length, self.gamma)
        return decoder.apply(variables, None, positions, cache, length, mask,
                             embeds=jnp.concatenate([first, masks], axis=1), lora=draft.get("lora"))

    def block_logits(self, params, draft, cache, length, last):
        """Logits [B, gamma, V] of the block (without a correction), and the cache with scratch writes."""
        hidden, cache = self.block_hidden(params, draft, cache, length, last)
        return self.head_logits(params, draft, hidden), cache

    def head_logits(self, params, draft, hidden):
        """The draft's head (its vocabulary's rows, if it has one) over final-normed states."""
        return Decoder(self.config).apply({"params": params}, hidden, draft.get("head"), method="logits")

    def init_state(self, params, draft, cache):
        # A dynamic tree changes every step: the loop carries the one drafted to its verification.
        return self.tree.arrays(cache[0]["k"].shape[0]) if self.tree.dynamic else ()

    def tree_arrays(self, state, batch: int):
        return state if self.tree.dynamic else self.tree.arrays(batch)

    def draft(self, params, draft, cache, length, last, state, key, sampling: Sampling):
        hidden, cache = self.block_hidden(params, draft, cache, length, last)
        nodes, valid, q, state = self.propose(params, draft, hidden, last, state, key, sampling)
        return nodes, valid, q, cache, state

    def propose(self, params, draft, hidden, last, state, key, sampling: Sampling, *, from_masks: bool = False):
        """(nodes, valid, q, state): the tree's tokens from a block's final-normed states [B, gamma, D] after the
        token `last`, through the previous-token correction where the draft has one (`from_masks`: see
        `corrected`)."""
        logits = self.head_logits(params, draft, hidden)
        if "correction" in draft:
            return *self.corrected(params, draft, hidden, logits, last, key, sampling, from_masks=from_masks), state
        b, k = logits.shape[0], self.tree.max_rank + 1
        if sampling.greedy:
            top, candidates = (jnp.max(logits, -1, keepdims=True), jnp.argmax(logits, -1)[..., None]) if k == 1 \
                else top_k(logits, k)
            # log q of the candidates, for a dynamic tree's choice (XLA drops it for a static tree)
            scores = top.astype(jnp.float32) - jax.nn.logsumexp(logits.astype(jnp.float32), -1, keepdims=True)
        else:
            logq = jax.nn.log_softmax(process_logits(logits, sampling), axis=-1)              # [B, gamma, V_draft]
            # k draws from q without replacement, in the order sampled verification tries them.
            drawn, candidates = draws(key, logq, k)
            # A dynamic tree's shape comes from q, never from the draws: which children a node tries
            # must not depend on what they turn out to be, or the rejection rule stops being exact.
            scores = top_k(logq, k)[0]
        # Simultaneous drafting: a node's candidates depend on its depth only, not on its parent.
        tree, depth, rank = self.tree.layout(scores)
        rows = jnp.arange(b)[:, None]
        nodes = draft_vocab.token_ids(draft, candidates[rows, depth, rank]).astype(jnp.int32)
        state = tree if self.tree.dynamic else state
        if sampling.greedy:
            return nodes, jnp.ones(nodes.shape, bool), None, state
        valid = jnp.isfinite(drawn[rows, depth, rank])  # q(x) = 0 is no draw
        q = jnp.exp(logq)[rows, jnp.minimum(tree.depths, self.gamma - 1)]                  # node -> q of depth + 1
        q = draft_vocab.full_probs(draft, q, self.config.vocab_size)
        return nodes, valid, q, state

    def corrected(self, params, draft, hidden, logits, last, key, sampling: Sampling, *, from_masks: bool = False):
        """(nodes, valid, q) of a static tree drafted depth by depth with the previous-token correction:
        a node's children are its depth's top candidates rescored given the node's own token. `from_masks`:
        the positions [B, gamma] are all mask tokens, so the root's children are rescored given `last` too."""
        tree, b, width = self.tree, last.shape[0], self.tree.max_rank + 1
        assert not tree.dynamic, "a corrected draft drafts static trees"  # methods drops the correction for a dynamic one
        base, cand = top_k(logits, min(CANDIDATES, logits.shape[-1]))                 # [B, gamma, K]
        table = draft["head"] if draft_vocab.has_vocab(draft) else params.get("lm_head", params["embed"])
        head_rows = quant.take(table, cand).astype(hidden.dtype)                               # [B, gamma, K, D]
        depths, parents, ranks = tree.node_depths, tree.parents, tree.node_ranks
        decoder, rows = Decoder(self.config), jnp.arange(b)[:, None]
        nodes = jnp.zeros((b, tree.num_nodes), jnp.int32).at[:, 0].set(last)
        valid = jnp.ones((b, tree.num_nodes), bool)
        q = None if sampling.greedy else jnp.zeros((b, tree.num_nodes, self.config.vocab_size), jnp.float32)
        for d in range(tree.depth + 1):
            level = np.flatnonzero(depths == d)
            kids = np.flatnonzero((depths == d + 1) & (np.arange(tree.num_nodes) > 0))
            if sampling.greedy and not len(kids):
                continue
            at = min(d, self.gamma - 1)  # a leaf at depth gamma has no position; its q is never read
            scores = base[:, at, None]  # the root's children: a block's depth 1 position saw the last token itself
            if d or from_masks:
                embeds = decoder.apply({"params": params}, nodes[:, level], method="embed_tokens")
                scores = scores + jnp.einsum("bnd,bkd->bnk", delta(draft["correction"], hidden[:, at, None], embeds),
                                             head_rows[:, at])
            if sampling.greedy:
                order = top_k(scores, width)[1]
            else:
                logq = jax.nn.log_softmax(process_logits(scores, sampling), axis=-1)            # [B, n_d, K]
                # draws without replacement, in the order verification tries them, as in `propose`
                drawn, order = draws(jax.random.fold_in(key, d), logq, width)
                probs = jnp.zeros((b, len(level), logits.shape[-1]), jnp.float32).at[
                    rows[..., None], jnp.arange(len(level))[None, :, None], cand[:, at, None]].set(jnp.exp(logq))
                q = q.at[:, level].set(draft_vocab.full_probs(draft, probs, self.config.vocab_size))
            if len(kids):
                slot = np.searchsorted(level, parents[kids])  # each kid's parent's place in its level
                picked = jnp.take_along_axis(cand[:, at], order[:, slot, ranks[kids]], axis=1)
                nodes = nodes.at[:, kids].set(draft_vocab.token_ids(draft, picked).astype(jnp.int32))
                if not sampling.greedy:
                    valid = valid.at[:, kids].set(jnp.isfinite(drawn[:, slot, ranks[kids]]))
        return nodes[:, 1:], valid[:, 1:], q  # the root is no draft; q is per node, root first


PAPER_GAMMA = 4  # a dynamic tree's depth: that of the static trees it stands in for


def default_gamma(tree: str | None) -> int:
    """gamma when none is given and the speed model does not choose it (`s3djax.defaults`): a named tree's own depth,
    a dynamic tree the paper's, else the data file's."""
    from s3djax.speculative import tree as trees

    if tree and tree.startswith("dynamic-"):
        return PAPER_GAMMA
    return trees.named_depth(tree) or defaults.fallback("depth", "s3d")


def default_plan(num_layers: int) -> SkipPlan:
    """S3D's default draft: skip about half the layers symmetrically around the middle (8-21 of 30)."""
    return SkipPlan.symmetric_middle(num_layers, num_layers // 2 - 1)


def build(m, ar, opts, dtype: str, measure: bool):
    """`--method s3d`: the draft file (or the untrained mask token), its plan, gamma (chosen on this machine where
    unset), the tree, in-verify drafting, the draft's vocabulary and weights."""
    from s3djax.built import Built, about_file, chosen_depth, finetuned_target
    from s3djax.errors import UserError
    from s3djax.loading import DTYPES
    from s3djax.speculative import tree as trees
    from s3djax.speculative.draft_params import init_draft, load_draft
    from s3djax.speculative.drafters.s3d_in_verify import InVerifyS3DDrafter
    from s3djax.speculative.loop import SpecDecoder

    if opts.in_verify not in (None, "on", "off"):
        raise UserError(f"--in-verify must be on or off, got {opts.in_verify}")
    in_verify = (defaults.fallback("in_verify") if opts.in_verify is None else opts.in_verify) == "on"
    chosen = None
    if opts.gamma is None and opts.tree in (None, "chain") and not in_verify:
        chosen = chosen_depth("s3d", m, ar, opts, dtype, measure)
    gamma = opts.gamma if opts.gamma is not None else chosen.depth if chosen else default_gamma(opts.tree)
    if gamma < 1:
        raise UserError(f"--gamma must be at least 1, got {gamma}")
    path = opts.draft_path
    draft, meta = load_draft(path, m.config, DTYPES[dtype]) if path not in (None, "none") else (None, {})
    plan = SkipPlan.parse(opts.skip, m.config.num_layers) if opts.skip else None
    if plan is None:  # a trained draft brings the plan it was trained with
        plan = SkipPlan.parse(meta["skip"], m.config.num_layers) if meta.get("skip") else \
            default_plan(m.config.num_layers)
    warnings, params = [], m.params
    if draft is None:
        draft = init_draft(m.params, m.config, plan)
        warnings.append("no trained draft: using an untrained mask token, so acceptance will be low")
    elif "layers" in draft:  # a full-mode draft fine-tuned the kept layers: they verify too
        params = finetuned_target(m, draft.pop("layers"), dtype)
        warnings.append(f"{path} was trained in full mode: the verifying model is its fine-tuned "
                        "target, not the original weights")
    if in_verify and opts.tree not in (None, "chain"):
        raise UserError(f"--in-verify drafts a chain, so s3d's tree must be the chain, not {opts.tree}")

    # Drafting inside the verify pass reads the target's weights and the adapters on its draft rows: nothing to fold.
    draft = draft_weights.attach(draft_vocab.attach(draft, meta, params), params, opts.draft_weights, DTYPES[dtype],
                                 plan=plan, fold=not in_verify)
    kind = InVerifyS3DDrafter if in_verify else S3DDrafter
    drafter = kind(m.config, plan, trees.resolve(opts.tree, gamma), gamma)
    if "correction" in draft and drafter.tree.dynamic:  # the correction conditions a fixed shape's children
        draft = {k: v for k, v in draft.items() if k != "correction"}
        warnings.append(f"{opts.tree} drafts without the draft's previous-token correction, which needs a "
                        "static tree")
    return Built(SpecDecoder.create(ar, drafter), (params, draft), warnings,
                 f"draft {about_file(path, meta)}, skip {plan.spec()}, gamma {gamma}"
                 + (f" ({chosen.how})" if chosen else "")
                 + (", drafting inside the verify pass" if in_verify else "")
                 + draft_vocab.about(meta)
                 + draft_weights.about(draft, params)
                 + (f", previous-token correction rank {meta['correction_rank']}" if "correction" in draft else ""),
                 chosen)
