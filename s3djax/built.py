"""What a method builder returns, and the pieces the builders share: each drafter module's `build` (the registry in
`methods`), and `methods.build` itself, which makes a chain give way to prompt lookup in one place (`giving_way`).

Kept below both, so `methods` can import the drafters' builders and they can import these.
"""

from __future__ import annotations

import dataclasses
import os

from s3djax import defaults, quant
from s3djax.errors import UserError
from s3djax.loading import DTYPES, LoadedModel
from s3djax.model import with_layers
from s3djax.speculative.draft_params import load_draft


@dataclasses.dataclass
class Built:
    decoder: object
    params: object
    warnings: list[str]
    draft: str = ""  # which draft a speculative method uses, for the stats line
    chosen: object = None  # the `defaults.Choice` of a chain depth the speed model chose on this machine


def finetuned_target(m: LoadedModel, layers: dict, dtype: str) -> dict:
    """The target with a full-mode S3D draft's fine-tuned layers in place, quantized like the rest."""
    params = with_layers(m.params, layers)
    return quant.apply(params, m.quant, DTYPES[dtype], m.matmul) if m.quant != "none" else params


def target_from(m: LoadedModel, path: str, dtype: str) -> tuple[dict, dict]:
    """--target-from: (the fine-tuned target's params, the fine-tuned layers) of a full-mode S3D draft file."""
    draft, _ = load_draft(path, m.config, DTYPES[dtype])
    if "layers" not in draft:
        raise UserError(f"--target-from {path} is not a full-mode s3d draft (it has no layers)")
    return finetuned_target(m, draft["layers"], dtype), draft["layers"]


def about_file(path: str | None, meta: dict) -> str:
    """How a stats line names a trained artifact."""
    if not meta:
        return "untrained"
    return (f"{os.path.relpath(path)} ({meta.get('mode', 'trained')}, {meta.get('steps', '?')} steps, trained on "
            f"{meta.get('trained_on', '?')})")


def lookup_switch(opts, method: str) -> int:
    """--lookup, else configs/defaults.yaml's switch for the method (0: never)."""
    return (defaults.fallback("lookup_switch", method) or 0) if opts.lookup is None else opts.lookup


def with_lookup(drafter, opts, method: str):
    """(the drafter, giving way to prompt lookup's chain where `lookup_switch` says, and the words for it)."""
    from s3djax.speculative.drafters.lookup import NGRAM, WithLookup

    switch = lookup_switch(opts, method)
    if switch < 0:
        raise UserError(f"--lookup must be 0 (never) or more, got {switch}")
    if switch and drafter.tree.spine_width != 1:
        if opts.lookup:
            raise UserError(f"--lookup drafts a chain, so {method}'s tree must be the chain, not "
                            f"{opts.tree or drafter.tree.spine_name}")
        switch = 0
    if not switch:
        return drafter, ""
    return WithLookup(drafter, switch, max(switch, NGRAM)), f", lookup where {switch}+ tokens match"


def giving_way(built: Built, opts, method: str) -> Built:
    """A built speculative method whose drafter gives way to prompt lookup (`with_lookup`)."""
    drafter, about_lookup = with_lookup(built.decoder.drafter, opts, method)
    return dataclasses.replace(built, decoder=dataclasses.replace(built.decoder, drafter=drafter),
                               draft=built.draft + about_lookup)


def chosen_depth(method: str, m: LoadedModel, ar, opts, dtype: str, measure: bool, gives_way: bool = True,
                 fixed: tuple[int, str] | None = None):
    """`defaults.depth` for a method's chain, its record used only where it was made with this lookup switch
    (`gives_way`: the method's chain gives way to lookup's); `fixed`: its depth where nothing measured decides."""
    import jax

    from s3djax import methods
    from s3djax.speculative import gate

    leaf = jax.tree.leaves(m.params)[0]
    measure = measure and isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)  # not a shape alone

    def build_at(g):  # as it will run; the measurement itself makes every step draft by the model
        options = {**dataclasses.asdict(opts), **defaults.depth_options(method, g)}
        if not gives_way:
            options["lookup"] = None
        return methods.build(method, m, max_cache_len=defaults.CACHE_LEN, dtype=dtype, measure=False, **options)

    # What build_at's steps depend on besides the depth, read off its inputs rather than built to be read.
    setting = {"config": repr(m.config), "matmul": m.matmul, "dtype": dtype,
               "weights": [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(m.params)],
               "options": {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("gamma", "max_draft", "lookup")}}
    return defaults.depth(method, build_at, setting, model=m.name, draft_path=opts.draft_path, greedy=ar.sampling.greedy,
                          lookup_switch=lookup_switch(opts, method) if gives_way else 0, measure=measure, fixed=fixed,
                          prompt_ids=lambda: gate.prompt_ids(m.tokenizer))
