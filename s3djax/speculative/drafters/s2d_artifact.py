"""S2D's nested draft as a file and as a method: exits, thresholds, adapters, and `--method s2d`'s builder.

The drafting itself, and the upkeep of the nested draft's cache, is `s2d.S2DDrafter`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from s3djax.built import Built, about_file, target_from
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.model import layers_of
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import draft_vocab, draft_weights
from s3djax.speculative.draft_params import init_draft
from s3djax.speculative.drafters.s2d import S2DDrafter


ARTIFACT_KIND = "s2d nested draft"
FALLBACK_THRESHOLDS = (0.9, 0.8)  # untrained or unswept draft: only very confident shallow exits stop


def parse_exits(spec: str, num_layers: int) -> tuple[int, ...]:
    """"4,6,8" -> (4, 6, 8): increasing layer counts; the last is the draft's depth N_d < num_layers."""
    try:
        exits = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise UserError(f"invalid exits {spec!r}: expected layer counts such as 4,6,8") from None
    if not exits or any(b <= a for a, b in zip(exits, exits[1:])) or exits[0] < 1 or exits[-1] >= num_layers:
        raise UserError(f"invalid exits {spec!r}: layer counts must increase, from 1 to below the model's "
                        f"{num_layers} layers")
    return exits


def parse_thresholds(text: str, num_exits: int) -> tuple[float, ...]:
    """"a,b,c" -> the n-1 thresholds that matter: one per exit, the deepest's ignored (it always stops),
    so n-1 values are accepted too."""
    try:
        values = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UserError(f"invalid --thresholds {text!r}: expected numbers such as 0.8,0.6,0") from None
    if len(values) not in (num_exits - 1, num_exits) or any(v < 0 for v in values):
        raise UserError(f"--thresholds needs one non-negative value per exit ({num_exits}; the deepest exit always "
                        f"stops, so its value may be left out and is ignored), got {text!r}")
    return values[:num_exits - 1]


def init_lora(params, config: ModelConfig, depth: int, rank: int, key) -> list[dict]:
    """Adapters on every linear of the first `depth` layers, B = 0 so they start as no-ops."""
    plan = SkipPlan.skipping_layers(config.num_layers, range(depth, config.num_layers))
    return init_draft(params, config, plan, lora_rank=rank, key=key)["lora"][:depth]


def target_key(quant_mode: str, dtype: str, full_mode: bool) -> str:
    """Which of the artifact's per-target default thresholds apply: float32, bfloat16, int8, int8-all or
    full-mode (a --target-from target, whatever its weights' form)."""
    return "full-mode" if full_mode else quant_mode if quant_mode != "none" else dtype


def extra_bytes(params, draft) -> int:
    """The draft's parameter bytes not shared with the target (its memory cost beside the target)."""
    return sum(leaf.nbytes for leaf in draft_weights.own_leaves(params, draft))


def build(m, ar, opts, dtype: str, measure: bool):
    """`methods.build`'s s2d: the nested draft (opts.draft_path), its thresholds for this target, and the
    target itself: the loaded model, or with opts.target_from's full-mode S3D layers in place."""
    from s3djax.loading import DTYPES
    from s3djax.speculative.draft_params import load_artifact
    from s3djax.speculative.drafters.chain import about_spine, chosen_spine
    from s3djax.speculative.loop import SpecDecoder

    path, warnings = opts.draft_path, []
    if path is None:
        raise UserError(f"no nested s2d draft is registered for {m.name}: train one with python -m train.s2d "
                        "and pass --draft PATH (or --draft none for the untrained nested draft)")
    if path == "none":
        exits, lora, meta = parse_exits(default_exits(m.config.num_layers), m.config.num_layers), None, {}
        warnings.append("no trained nested draft: its exits are the bare model's layers, so acceptance will be low")
    else:
        tree, meta = load_artifact(path, DTYPES[dtype], ARTIFACT_KIND)
        if meta.get("method") != "s2d":
            raise UserError(f"{path} is not an s2d nested draft (method {meta.get('method')!r})")
        exits = parse_exits(",".join(map(str, meta["exits"])), m.config.num_layers)
        lora = tree.get("lora")
        if lora is not None and not _fits(lora, layers_of(m.params)[:exits[-1]]):
            raise UserError(f"{path} was trained for a model of another shape than {m.name}")

    params, full_mode = m.params, opts.target_from is not None
    draft = {} if lora is None else {"lora": lora}
    if full_mode:
        params, finetuned = target_from(m, opts.target_from, dtype)
        if any(int(i) < exits[-1] for i in finetuned):  # the draft keeps the original layers
            draft["layers"] = layers_of(m.params)[:exits[-1]]

    key = target_key(m.quant, dtype, full_mode)
    if opts.thresholds:
        thresholds, source = parse_thresholds(opts.thresholds, len(exits)), "--thresholds"
    elif key in meta.get("thresholds", {}):
        thresholds, source = tuple(meta["thresholds"][key])[:len(exits) - 1], f"swept for {key}"
    else:
        thresholds, source = default_thresholds(len(exits)), "fallback"
    draft["thresholds"] = jnp.asarray(thresholds, jnp.float32)
    draft = draft_vocab.attach(draft, meta, m.params)
    # int8 copies of the draft's base layers (the original model's, whatever the target), its adapters folded in:
    # its cache is its own.
    n = m.config.num_layers
    draft = draft_weights.attach(draft, m.params, opts.draft_weights, DTYPES[dtype],
                                 plan=SkipPlan.skipping_layers(n, range(exits[-1], n)), fold=True)

    # The draft file may carry the tree and deepest draft measured fastest; the paper's chain of 6 otherwise.
    tree, chosen = chosen_spine("s2d", m, ar, opts, dtype, measure, meta, 6,
                                 as_recorded=not (opts.thresholds or opts.target_from))
    drafter = S2DDrafter(m.config, tree, exits)
    if full_mode:
        warnings.append(f"verifying with {opts.target_from}'s fine-tuned layers, not the original weights")
    about = (f"nested draft {about_file(path if path != 'none' else None, meta)}, exits {','.join(map(str, exits))}, "
             f"thresholds {','.join(f'{t:g}' for t in thresholds)} ({source}), {about_spine(tree, chosen)}, "
             f"extra draft memory "
             f"{extra_bytes(params, draft) / 2**20:.1f} MiB" + draft_vocab.about(meta)
             + draft_weights.about(draft, m.params))
    return Built(SpecDecoder.create(ar, drafter), (params, draft), warnings, about, chosen)


def _fits(lora, layers) -> bool:
    weights = [{**layer["attn"], **layer["mlp"]} for layer in layers]
    return len(lora) == len(layers) and all(
        name in layer and (adapter["a"].shape[0], adapter["b"].shape[1]) == tuple(layer[name].shape)
        for adapters, layer in zip(lora, weights) for name, adapter in adapters.items())


def default_exits(num_layers: int) -> str:
    """Without an artifact: exits at 2/15, 3/15 and 4/15 of the stack (4, 6, 8 of SmolLM2's 30 layers)."""
    exits = sorted({max(1, round(num_layers * f / 15)) for f in (2, 3, 4)} - {num_layers})
    return ",".join(map(str, exits or [max(1, num_layers - 1)]))


def default_thresholds(num_exits: int) -> tuple[float, ...]:
    return tuple(np.resize(FALLBACK_THRESHOLDS, num_exits - 1).tolist())
