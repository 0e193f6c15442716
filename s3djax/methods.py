"""Decoding methods by name: one place that turns CLI-level choices into a decoder and its params."""

from __future__ import annotations

import dataclasses
import os

from s3djax import quant, registry
from s3djax.decode import ARDecoder
from s3djax.errors import UserError
from s3djax.loading import LoadedModel
from s3djax.sampling import Sampling
from s3djax.skip_plan import SkipPlan

METHODS = ("ar", "s3d")


def default_draft_plan(num_layers: int) -> SkipPlan:
    """S3D's default: skip about half the layers symmetrically around the middle (8-21 of 30)."""
    return SkipPlan.symmetric_middle(num_layers, num_layers // 2 - 1)


@dataclasses.dataclass
class Built:
    decoder: object
    params: object
    warnings: list[str]
    draft: str = ""  # which draft s3d uses, for the stats line


def build(method: str, m: LoadedModel, *, max_cache_len: int, sampling: Sampling = Sampling(),
          dtype: str = "float32", skip: str = "", gamma: int = 4, tree: str = "chain",
          draft_path: str | None = None) -> Built:
    """draft_path: a trained draft file; None takes the model's shipped draft if it has one, and
    "none" the untrained mask token."""
    tok = m.tokenizer
    eos = set(m.config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    plan = SkipPlan.parse(skip, m.config.num_layers) if skip else None
    ar = ARDecoder(m.config, max_cache_len, eos_ids=tuple(sorted(eos)), pad_id=tok.pad_token_id or 0,
                   sampling=sampling, cache_dtype=dtype)
    if method == "ar":
        return Built(dataclasses.replace(ar, plan=plan), m.params, [])
    if method != "s3d":
        raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    from s3djax.loading import DTYPES
    from s3djax.spec import tree as trees
    from s3djax.spec.draft_params import init_draft, load_draft, with_layers
    from s3djax.spec.drafters.s3d import S3DDrafter
    from s3djax.spec.loop import SpecDecoder

    if gamma < 1:
        raise UserError(f"--gamma must be at least 1, got {gamma}")
    entry = registry.entries().get(m.name)
    if draft_path is None and entry:
        draft_path = entry.draft_path()
    draft, meta = load_draft(draft_path, m.config, DTYPES[dtype]) if draft_path not in (None, "none") else (None, {})
    if plan is None:  # a trained draft brings the plan it was trained with
        plan = SkipPlan.parse(meta["skip"], m.config.num_layers) if meta.get("skip") else \
            default_draft_plan(m.config.num_layers)
    warnings, params = [], m.params
    if draft is None:
        draft = init_draft(m.params, m.config, plan)
        warnings.append("no trained draft: using an untrained mask token, so acceptance will be low")
    elif "layers" in draft:  # a full-mode draft fine-tuned the kept layers: they verify too
        params = with_layers(m.params, draft.pop("layers"))
        if m.quant != "none":  # the fine-tuned layers arrive in float
            params = quant.apply(params, m.quant, DTYPES[dtype], m.matmul)
        warnings.append(f"{draft_path} was trained in full mode: the verifying model is its fine-tuned "
                        "target, not the original weights")
    spec_tree = trees.resolve(tree, gamma)
    drafter = S3DDrafter(m.config, plan, spec_tree, gamma)
    about = (f"{os.path.relpath(draft_path)} ({meta.get('mode', '?')}, {meta.get('steps', '?')} steps, trained on "
             f"{meta.get('trained_on', '?')})" if meta else "untrained")
    return Built(SpecDecoder.create(ar, drafter), (params, draft), warnings, f"draft {about}, skip {plan.spec()}")
