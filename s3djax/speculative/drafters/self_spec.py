"""Draft & Verify (Self-Spec, Zhang et al. 2024): the target with some attention and MLP sub-layers
skipped drafts one token at a time, until its top-1 probability falls below an adaptive threshold.

Training-free: the draft is the target's own weights. It reads and writes the target's cache, so
kept attention layers see the committed context as it is; the sub-layers it skips need no K/V.
The threshold follows the paper's Eq. 2-4 after every verify step.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import yaml

from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.errors import UserError
from s3djax.skip_plan import DynamicPlan, SkipPlan
from s3djax.speculative import draft_weights
from s3djax.speculative.drafters.chain import ChainDrafter
from s3djax.speculative.tree import TreeSpec


@dataclasses.dataclass(frozen=True)
class AdaptiveThreshold:
    """The paper's defaults (its Table 6, MT-Bench row): start at 0.6, target acceptance 0.85."""
    initial: float = 0.6
    target: float = 0.85  # alpha
    step: float = 0.01    # epsilon
    beta1: float = 0.5    # smoothing of the acceptance rate
    beta2: float = 0.9    # smoothing of the threshold

    def init(self):
        return {"threshold": jnp.float32(self.initial), "rate": jnp.float32(0.0), "stages": jnp.int32(0)}

    def update(self, state, accepted, drafted):
        """One verify stage: rate <- b1 rate + (1 - b1) accepted/drafted (b1 = 0 at the first stage);
        threshold <- b2 threshold + (1 - b2) (threshold + eps if rate <= alpha else threshold - eps).

        A stage that drafted nothing carries no acceptance rate and leaves both unchanged. The
        threshold stays in [0, 1]: above 1 nothing would ever be drafted again.
        """
        drafted_any = drafted > 0
        stage_rate = accepted / jnp.maximum(drafted, 1)
        beta1 = jnp.where(state["stages"] == 0, 0.0, self.beta1)
        rate = beta1 * state["rate"] + (1 - beta1) * stage_rate
        proposal = jnp.where(rate <= self.target, state["threshold"] + self.step, state["threshold"] - self.step)
        threshold = jnp.clip(self.beta2 * state["threshold"] + (1 - self.beta2) * proposal, 0.0, 1.0)
        return {"threshold": jnp.where(drafted_any, threshold, state["threshold"]).astype(jnp.float32),
                "rate": jnp.where(drafted_any, rate, state["rate"]).astype(jnp.float32),
                "stages": state["stages"] + drafted_any.astype(jnp.int32)}


@dataclasses.dataclass(frozen=True)
class SelfSpecDrafter(ChainDrafter):
    pause = ChainDrafter.unchanged  # its threshold learns from verify steps alone; its draft reads the target's cache
    """Draft params: {} (the plan is static), {"attn", "mlp"} flags (the search's traced plan), a draft
    vocabulary's {"vocab", "head"} (the plan file's "vocab", `train.draft_vocab`), and int8 "weights"
    (`s3djax.speculative.draft_weights`)."""
    config: ModelConfig
    plan: SkipPlan | None  # None: the plan is traced, from the draft params {"attn", "mlp"} (the search)
    tree: TreeSpec
    threshold: AdaptiveThreshold = AdaptiveThreshold()

    def init_state(self, params, draft, cache):
        return {**self.threshold.init(), "drafted": jnp.zeros(cache[0]["k"].shape[:1], jnp.int32)}

    def block(self, params, draft, cache, state, tokens, positions, slot, mask):
        dynamic = None if self.plan is not None else DynamicPlan(draft["attn"], draft["mlp"])
        decoder, variables = Decoder(self.config, self.plan), {"params": draft_weights.of(params, draft)}
        hidden, cache = decoder.apply(variables, tokens, positions, cache, slot, mask, dynamic=dynamic)
        return decoder.apply(variables, hidden[:, 0], draft.get("head"), method="logits"), cache, state

    def confident(self, state, probs):
        return jnp.max(probs, axis=-1) >= state["threshold"]

    def draft(self, params, draft, cache, length, last, state, key, sampling):
        nodes, valid, child_probs, cache, state = super().draft(params, draft, cache, length, last, state, key, sampling)
        chain = valid[:, ::self.tree.max_rank + 1]  # the chain node of each depth
        return nodes, valid, child_probs, cache, {**state, "drafted": chain.sum(1).astype(jnp.int32)}

    def gave_way(self, params, draft, cache, length, last, nodes, state):
        # Nothing drafted, so the step says nothing of the plan's acceptance: the threshold stays.
        return cache, {**state, "drafted": jnp.zeros_like(state["drafted"])}

    def update(self, state, length, accepted, path, emitted):
        # Batch size is 1 in speculative decoding: the threshold is the row's.
        return {**self.threshold.update(state, accepted[0], state["drafted"][0]), "drafted": state["drafted"]}


def save_plan(path: str, plan: SkipPlan, meta: dict) -> None:
    """A searched plan as YAML: the skip spec string (as --skip takes it) and how it was found."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        # Flow style for lists of scalars: a draft vocabulary's 8k ids stay a few lines, not 8k.
        yaml.safe_dump({"skip": plan.spec(), "num_layers": plan.num_layers, **meta}, f, sort_keys=False,
                       default_flow_style=None, width=120)


def load_plan(path: str, num_layers: int) -> tuple[SkipPlan, dict]:
    """The plan, and the file's record: how it was found, the max draft it records (the search's, or the
    one measured fastest with it) and any draft vocabulary."""
    if not os.path.isfile(path):
        raise UserError(f"no such skip plan file: {path}")
    try:
        with open(path) as f:
            record = yaml.safe_load(f)
        spec = record["skip"]
    except (yaml.YAMLError, TypeError, KeyError) as e:
        raise UserError(f"{path} is not a skip plan file (a YAML mapping with a 'skip' entry): {e}") from None
    if record.get("num_layers", num_layers) != num_layers:
        raise UserError(f"{path} is a plan for {record['num_layers']} layers, not this model's {num_layers}")
    max_draft = record.get("max_draft")
    if max_draft is not None and not (isinstance(max_draft, int) and max_draft >= 1):
        raise UserError(f"{path}: max_draft must be a whole number of at least 1, got {max_draft!r}")
    return SkipPlan.parse(spec, num_layers), record


def build(m, ar, opts, dtype: str, measure: bool):
    """`--method self-spec`: the searched plan (--skip, or the plan file), its tree and max draft."""
    from s3djax.built import Built
    from s3djax.loading import DTYPES
    from s3djax.speculative import draft_vocab
    from s3djax.speculative.drafters.chain import about_spine, chosen_spine
    from s3djax.speculative.drafters.s3d import default_plan
    from s3djax.speculative.loop import SpecDecoder

    warnings, meta = [], {}
    if opts.skip:
        plan, about = SkipPlan.parse(opts.skip, m.config.num_layers), "--skip"
    elif opts.draft_path not in (None, "none"):
        (plan, meta), about = load_plan(opts.draft_path, m.config.num_layers), os.path.relpath(opts.draft_path)
    else:
        plan, about = default_plan(m.config.num_layers), "the default plan"
        warnings.append("no searched skip plan: skipping the middle layers (python -m train.search_skip finds one)")
    # The plan file's tree and max draft where it records them (the shipped plan's: measured fastest), else the
    # paper's chain of 12.
    tree, chosen = chosen_spine("self-spec", m, ar, opts, dtype, measure, meta, 12,
                                 as_recorded=not opts.skip)
    drafter = SelfSpecDrafter(m.config, plan, tree)
    draft = draft_weights.attach(draft_vocab.attach({}, meta, m.params), m.params, opts.draft_weights, DTYPES[dtype],
                                 plan=plan)
    return Built(SpecDecoder.create(ar, drafter), (m.params, draft), warnings,
                 f"skip {plan.spec()} ({about}), {about_spine(tree, chosen)}" + draft_vocab.about(meta)
                 + draft_weights.about(draft, m.params), chosen)
