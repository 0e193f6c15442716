"""Decoding methods by name: one place that turns CLI-level choices into a decoder and its params."""

from __future__ import annotations

import dataclasses
import os

import jax

from s3djax import device, quant, registry
from s3djax.built import Built, about_file, finetuned_target, target_from
from s3djax.decode import ARDecoder
from s3djax.errors import UserError
from s3djax.loading import DTYPES, LoadedModel, ModelSource
from s3djax.model import abstract_params
from s3djax.sampling import Sampling
from s3djax.skip_plan import SkipPlan

METHODS = ("ar", "s3d", "self-spec", "kangaroo", "s2d", "lookup")


# The FASTEST_ tables are keyed by device.platform(); a CPU whose vector unit has no entry takes "cpu"'s.
# S3D's chain depth measured fastest per platform, the CPU kernels on, the shipped draft, lookup 1, MT-Bench 80 and
# HumanEval 40. AVX2 (2-core Zen 3): gamma 2 1.43x / 1.48x ar, 3 1.39x / 1.46x
# (benchmarks/results/s3d-gamma-14k-draft-cpu-2026-11-27). AVX-512 (2-core Zen 4), where a 5-token verify costs
# 0.90x an AR step against 1.27x: 4 1.67x / 1.88x, 3 1.67x / 1.83x, 2 1.61x / 1.73x
# (benchmarks/results/s3d-gamma-zen4-cpu-2026-11-28). The 28-layer draft at lookup 2 keeps 4 there: 1.71x / 1.91x
# against 1.63x / 1.77x at 2 (s3d-kept-layers-gamma2-zen4-cpu-2026-11-28), and 1.74x / 1.98x against 1.73x / 1.92x
# at 3 and 1.72x / 1.98x at 5 (s3d-kept-layers-gamma-zen4-cpu-2026-11-28). No GPU has measured it: the paper's 4.
FASTEST_GAMMA = {"cpu": 2, "cpu-avx512": 4}
PAPER_GAMMA = 4
# Prompt lookup's deepest draft (transformers' prompt_lookup_num_tokens, vLLM's num_speculative_tokens) measured
# fastest per platform, MT-Bench and HumanEval alike. AVX2 (2-core Zen 3): 2, 1.16x / 1.28x ar against 1.04x / 1.12x at
# 4 (benchmarks/results/lookup-depth-cpu-2026-11-25.md, MT-Bench 12 / HumanEval 6). AVX-512 (2-core Zen 4): 4,
# 1.38x / 1.46x against 1.36x / 1.44x at 3 and 1.36x / 1.40x at 2 (MT-Bench 80 / HumanEval 40,
# benchmarks/results/defaults-zen4-cpu-2026-11-28). Elsewhere AVX2's.
FASTEST_LOOKUP_DEPTH = {"cpu": 2, "cpu-avx512": 4}
LOOKUP_NGRAM = 3
# A drafter's chain gives way to lookup's at a step whose last N+ tokens occurred before (0: never), N per method
# and platform. S3D: 1 measured fastest on the CPU (benchmarks/results/s3d-lookup-cpu-2026-11-25.md: 1.25x and
# 1.54x ar on MT-Bench and HumanEval, against 1.21x/1.42x at 2, 1.16x/1.36x at 3 and 1.02x/1.18x without
# lookup). With the 28-layer draft at gamma 4 on AVX-512 (2-core Zen 4): 2, 1.73x / 2.01x ar on MT-Bench 80 /
# HumanEval 40, against 1.71x / 2.11x at 3, 1.69x / 1.92x at 1 and 1.57x / 1.78x without lookup, one round;
# MT-Bench chooses (benchmarks/results/s3d-kept-layers-lookup-zen4-cpu-2026-11-28). Self-Spec and Kangaroo on a
# chain of 2, switch 1 (benchmarks/results/lookup-drafters-cpu-2026-11-26/):
# Kangaroo 1.29x and 1.24x against its top2 tree's 1.16x and 1.09x without lookup, Self-Spec 1.06x and 1.23x
# against 0.90x and 0.95x, MT-Bench 12 and HumanEval 6. S2D at its max draft 1, switch 1
# (benchmarks/results/s2d-lookup-cpu-2026-11-27.md): 0.97x and 0.96x against 0.87x and 0.83x alone; on MT-Bench 80
# and HumanEval 40, 1.01x and 1.02x (s2d-lookup-mt-bench-80-humaneval-40-cpu-2026-11-27), under lookup alone.
# No GPU has measured it: the papers' drafters, without lookup.
FASTEST_LOOKUP = {"s3d": {"cpu": 1, "cpu-avx512": 2}, "self-spec": {"cpu": 1}, "kangaroo": {"cpu": 1},
                  "s2d": {"cpu": 1}}


# Whether S3D drafts its next chain inside the verify pass (s3djax.speculative.drafters.s3d_in_verify) rather than
# in a draft step of its own. Off on the CPU, where a forward's cost grows with its rows past about 6: on a 2-core
# Zen 4, MT-Bench 80 / HumanEval 40, one round, gamma 1 (6 rows) ran at 1.21x / 1.24x `ar` (tau 1.58 / 1.65) and
# gamma 2 (12 rows) at 0.89x / 0.90x (benchmarks/results/s3d-in-verify-zen4-cpu-2026-11-28), against the draft
# step's 1.73x / 2.01x at the defaults. No GPU has measured it: off.
FASTEST_IN_VERIFY = {"cpu": "off"}


def default_gamma(tree: str | None) -> int:
    """gamma when none is given: a named tree's own depth, a dynamic tree the paper's (the depth of
    the static trees it stands in for), else the platform's measured fastest."""
    from s3djax.speculative import tree as trees

    if tree and tree.startswith("dynamic-"):
        return PAPER_GAMMA
    return trees.named_depth(tree) or device.fastest(FASTEST_GAMMA, PAPER_GAMMA)


def default_lookup_depth() -> int:
    return device.fastest(FASTEST_LOOKUP_DEPTH, FASTEST_LOOKUP_DEPTH["cpu"])


def default_draft_plan(num_layers: int) -> SkipPlan:
    """S3D's default: skip about half the layers symmetrically around the middle (8-21 of 30)."""
    return SkipPlan.symmetric_middle(num_layers, num_layers // 2 - 1)


@dataclasses.dataclass(frozen=True)
class Options:
    """Every method's CLI-level choices; each method reads its own."""
    skip: str = ""                  # ar: the model's skip plan; s3d: the draft's
    gamma: int | None = None        # s3d: positions drafted per step (None: `default_gamma`)
    tree: str | None = None         # None: the draft file's recorded tree (autoregressive drafters), else the chain
    draft_path: str | None = None   # None: the model's shipped artifact for the method; "none": untrained
    max_draft: int | None = None    # autoregressive drafters: the deepest draft (default per method)
    exit_layer: int | None = None   # kangaroo
    eta: float | None = None        # kangaroo: stop drafting at top-1 confidence <= eta (None: the adapter's)
    thresholds: str | None = None   # s2d: per-exit confidence thresholds "a,b,c"
    target_from: str | None = None  # s2d: verify with a full-mode s3d draft's fine-tuned layers
    ngram: int | None = None        # lookup: the longest n-gram matched (None: LOOKUP_NGRAM)
    lookup: int | None = None       # s3d, self-spec, kangaroo, s2d: a chain gives way to lookup's where N+ tokens match
    draft_weights: str | None = None  # s3d, self-spec, kangaroo, s2d: the draft's own weights in int8 (None: measured fastest)
    in_verify: str | None = None    # s3d: "on" drafts the next chain inside the verify pass (None: measured fastest)


def options(args, method: str) -> dict:
    """One method's Options fields from parsed CLI arguments (`s3djax.cli.Parser.add_method_options`).

    --draft is a path, or METHOD=PATH pairs when a benchmark runs several methods; --skip is the
    whole model's plan for ar and the draft's for the others.
    """
    draft = args.draft
    if draft and "=" in draft:
        pairs = dict(item.partition("=")[::2] for item in draft.split(","))
        unknown = set(pairs) - set(METHODS)
        if unknown:
            raise UserError(f"--draft names unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
        draft = pairs.get(method)
    return dict(skip=args.skip, gamma=args.gamma, tree=args.tree, draft_path=draft, max_draft=args.max_draft,
                exit_layer=args.exit_layer, eta=args.eta, thresholds=args.thresholds, target_from=args.target_from,
                ngram=args.ngram, lookup=args.lookup, draft_weights=args.draft_weights, in_verify=args.in_verify)


def build(method: str, m: LoadedModel, *, max_cache_len: int, sampling: Sampling = Sampling(),
          dtype: str = "float32", **options) -> Built:
    """Options: see `Options`. draft_path: a trained draft (or a plan or adapter) file; None takes the
    model's shipped one if it has one, and "none" the untrained draft where the method has one."""
    builders = {"ar": _ar, "s3d": _s3d, "self-spec": _self_spec, "kangaroo": _kangaroo, "s2d": _s2d,
                "lookup": _lookup}
    if method not in builders:
        raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    unknown = set(options) - {f.name for f in dataclasses.fields(Options)}
    if unknown:
        raise UserError(f"unknown method options {sorted(unknown)}; choose from "
                        f"{', '.join(f.name for f in dataclasses.fields(Options))}")
    opts = Options(**options)
    if opts.max_draft is not None and opts.max_draft < 1:
        raise UserError(f"--max-draft must be at least 1, got {opts.max_draft}")
    if opts.draft_weights is not None:
        from s3djax.speculative.draft_weights import check_mode

        check_mode(opts.draft_weights)
    ar = ARDecoder(m.config, max_cache_len, eos_ids=m.eos_ids, pad_id=m.tokenizer.pad_token_id or 0,
                   sampling=sampling, cache_dtype=dtype)
    if opts.draft_path is None and method != "ar":
        entry = registry.entries().get(m.name)
        opts = dataclasses.replace(opts, draft_path=entry.draft_path(method) if entry else None)
    built = builders[method](m, ar, opts, dtype)
    if m.config.cpu_kernel:
        built.params = quant.pack_for_cpu(built.params)
    if jax.default_backend() == "gpu":
        built.params = quant.lay_out_for_gpu(built.params)
    return built


def check(method: str, source: ModelSource, *, max_cache_len: int, sampling: Sampling = Sampling(),
          dtype: str = "float32", quantization: str | None = None, matmul: str = "xla", **options) -> Built:
    """`build` on the model's shapes alone, before any weight is read, so bad options fail at once.

    The builder runs as it will on the loaded weights, but traced over abstract ones: every error the
    real build raises is raised here, from the same code. The returned decoder is the real one (it holds
    no weights; it checks prompts); the params are not.
    """
    quant.check_mode(quantization or "none", matmul)
    model = LoadedModel(source.name, source.config, None, source.tokenizer, 0.0, matmul)
    built = []

    def dry(params):
        if quantization not in (None, "none"):
            params = quant.apply(params, quantization, DTYPES[dtype], matmul)
        built.append(build(method, dataclasses.replace(model, params=params), max_cache_len=max_cache_len,
                           sampling=sampling, dtype=dtype, **options))

    jax.eval_shape(dry, abstract_params(source.config, DTYPES[dtype]))
    return dataclasses.replace(built[0], params=None)


def _ar(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    plan = SkipPlan.parse(opts.skip, m.config.num_layers) if opts.skip else None
    params = target_from(m, opts.target_from, dtype)[0] if opts.target_from else m.params
    return Built(dataclasses.replace(ar, plan=plan), params, [])


def _s3d(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    from s3djax.speculative import draft_vocab, draft_weights
    from s3djax.speculative import tree as trees
    from s3djax.speculative.draft_params import init_draft, load_draft
    from s3djax.speculative.drafters.s3d import S3DDrafter
    from s3djax.speculative.drafters.s3d_in_verify import InVerifyS3DDrafter
    from s3djax.speculative.loop import SpecDecoder

    gamma = default_gamma(opts.tree) if opts.gamma is None else opts.gamma
    if gamma < 1:
        raise UserError(f"--gamma must be at least 1, got {gamma}")
    path = opts.draft_path
    draft, meta = load_draft(path, m.config, DTYPES[dtype]) if path not in (None, "none") else (None, {})
    plan = SkipPlan.parse(opts.skip, m.config.num_layers) if opts.skip else None
    if plan is None:  # a trained draft brings the plan it was trained with
        plan = SkipPlan.parse(meta["skip"], m.config.num_layers) if meta.get("skip") else \
            default_draft_plan(m.config.num_layers)
    warnings, params = [], m.params
    if draft is None:
        draft = init_draft(m.params, m.config, plan)
        warnings.append("no trained draft: using an untrained mask token, so acceptance will be low")
    elif "layers" in draft:  # a full-mode draft fine-tuned the kept layers: they verify too
        params = finetuned_target(m, draft.pop("layers"), dtype)
        warnings.append(f"{path} was trained in full mode: the verifying model is its fine-tuned "
                        "target, not the original weights")
    draft = draft_weights.attach(draft_vocab.attach(draft, meta, params), params, opts.draft_weights, DTYPES[dtype],
                                 plan=plan)
    if opts.in_verify not in (None, "on", "off"):
        raise UserError(f"--in-verify must be on or off, got {opts.in_verify}")
    in_verify = (device.fastest(FASTEST_IN_VERIFY, "off") if opts.in_verify is None else opts.in_verify) == "on"
    if in_verify and opts.tree not in (None, "chain"):
        raise UserError(f"--in-verify drafts a chain, so s3d's tree must be the chain, not {opts.tree}")
    kind = InVerifyS3DDrafter if in_verify else S3DDrafter
    drafter = kind(m.config, plan, trees.resolve(opts.tree, gamma), gamma)
    if "correction" in draft and drafter.tree.dynamic:  # the correction conditions a fixed shape's children
        draft = {k: v for k, v in draft.items() if k != "correction"}
        warnings.append(f"{opts.tree} drafts without the draft's previous-token correction, which needs a "
                        "static tree")
    drafter, about_lookup = with_lookup(drafter, opts, "s3d")
    return Built(SpecDecoder.create(ar, drafter), (params, draft), warnings,
                 f"draft {about_file(path, meta)}, skip {plan.spec()}, gamma {gamma}"
                 + (", drafting inside the verify pass" if in_verify else "") + about_lookup
                 + draft_vocab.about(meta)
                 + draft_weights.about(draft, params)
                 + (f", previous-token correction rank {meta['correction_rank']}" if "correction" in draft else ""))


def with_lookup(drafter, opts: Options, method: str):
    """(the drafter, giving way to prompt lookup's chain where --lookup (or the method's measured fastest) says,
    and the words for it)."""
    from s3djax.speculative.drafters.lookup import WithLookup

    switch = device.fastest(FASTEST_LOOKUP.get(method, {}), 0) if opts.lookup is None else opts.lookup
    if switch < 0:
        raise UserError(f"--lookup must be 0 (never) or more, got {switch}")
    if switch and drafter.tree.spine_width != 1:
        if opts.lookup:
            raise UserError(f"--lookup drafts a chain, so {method}'s tree must be the chain, not "
                            f"{opts.tree or drafter.tree.spine_name}")
        switch = 0
    if not switch:
        return drafter, ""
    return WithLookup(drafter, switch, max(switch, LOOKUP_NGRAM)), f", lookup where {switch}+ tokens match"


def _self_spec(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    from s3djax.speculative import draft_vocab, draft_weights
    from s3djax.speculative.drafters.chain import about_spine, spine
    from s3djax.speculative.drafters.self_spec import SelfSpecDrafter, load_plan
    from s3djax.speculative.loop import SpecDecoder

    warnings, meta = [], {}
    if opts.skip:
        plan, about = SkipPlan.parse(opts.skip, m.config.num_layers), "--skip"
    elif opts.draft_path not in (None, "none"):
        (plan, meta), about = load_plan(opts.draft_path, m.config.num_layers), os.path.relpath(opts.draft_path)
    else:
        plan, about = default_draft_plan(m.config.num_layers), "the default plan"
        warnings.append("no searched skip plan: skipping the middle layers (python -m train.search_skip finds one)")
    # The plan file's tree and max draft where it records them (the shipped plan's: measured fastest), else the
    # paper's chain of 12.
    tree = spine(opts.tree, opts.max_draft, meta, 12, "self-spec")
    drafter, about_lookup = with_lookup(SelfSpecDrafter(m.config, plan, tree), opts, "self-spec")
    draft = draft_weights.attach(draft_vocab.attach({}, meta, m.params), m.params, opts.draft_weights, DTYPES[dtype],
                                 plan=plan)
    return Built(SpecDecoder.create(ar, drafter), (m.params, draft), warnings,
                 f"skip {plan.spec()} ({about}), {about_spine(tree)}" + about_lookup + draft_vocab.about(meta)
                 + draft_weights.about(draft, m.params))


def _kangaroo(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    from s3djax.speculative.drafters.kangaroo import build_kangaroo

    return _giving_way(build_kangaroo(m, ar, opts, dtype), opts, "kangaroo")


def _giving_way(built: Built, opts: Options, method: str) -> Built:
    """A built drafter wrapped by `with_lookup`, for the methods whose builder lives beside their drafter."""
    drafter, about_lookup = with_lookup(built.decoder.drafter, opts, method)
    return dataclasses.replace(built, decoder=dataclasses.replace(built.decoder, drafter=drafter),
                               draft=built.draft + about_lookup)


def _s2d(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    from s3djax.speculative.drafters.s2d_artifact import build_s2d

    return _giving_way(build_s2d(m, ar, opts, dtype), opts, "s2d")


def _lookup(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str) -> Built:
    from s3djax.speculative.drafters.lookup import LookupDrafter
    from s3djax.speculative.loop import SpecDecoder
    from s3djax.speculative.tree import TreeSpec

    if opts.draft_path not in (None, "none"):
        raise UserError(f"lookup drafts from the prompt and output, with no draft file (got {opts.draft_path})")
    if opts.tree not in (None, "chain"):
        raise UserError(f"lookup drafts one continuation, so its tree is the chain, not {opts.tree}")
    ngram = LOOKUP_NGRAM if opts.ngram is None else opts.ngram
    if ngram < 1:
        raise UserError(f"--ngram must be at least 1, got {ngram}")
    tree = TreeSpec.chain(opts.max_draft or default_lookup_depth())
    return Built(SpecDecoder.create(ar, LookupDrafter(m.config, tree, ngram)), (m.params, {}), [],
                 f"prompt lookup, n-grams {ngram} to 1, max draft {tree.depth}")
