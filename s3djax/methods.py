"""Decoding methods by name: one place that turns CLI-level choices into a decoder and its params."""

from __future__ import annotations

import dataclasses
import importlib

import jax

from s3djax import quant, registry
from s3djax.built import Built, giving_way, target_from
from s3djax.decode import ARDecoder
from s3djax.errors import UserError
from s3djax.loading import DTYPES, LoadedModel, ModelSource
from s3djax.model import abstract_params
from s3djax.options import Options, from_args
from s3djax.sampling import Sampling
from s3djax.skip_plan import SkipPlan

# Every method's builder, `build(m, ar, opts, dtype, measure) -> Built`: `ar`'s here, the others' one per drafter
# module, imported on first use.
BUILDERS = {"ar": "s3djax.methods:build_ar", "s3d": "s3djax.speculative.drafters.s3d:build",
            "self-spec": "s3djax.speculative.drafters.self_spec:build", "kangaroo": "s3djax.speculative.drafters.kangaroo:build",
            "s2d": "s3djax.speculative.drafters.s2d_artifact:build", "lookup": "s3djax.speculative.drafters.lookup:build"}
METHODS = tuple(BUILDERS)
# The methods whose chain gives way to prompt lookup's (--lookup; `built.giving_way`).
GIVES_WAY = ("s3d", "self-spec", "kangaroo", "s2d")


def options(args, method: str) -> dict:
    """One method's options from the command line's parsed flags (`s3djax.options.add_flags`)."""
    return from_args(args, method, METHODS)


def build(method: str, m: LoadedModel, *, max_cache_len: int, sampling: Sampling = Sampling(),
          dtype: str = "float32", measure: bool = True, gpu_layout: bool | None = None, **options) -> Built:
    """Options: see `Options`. draft_path: a trained draft (or a plan or adapter) file; None takes the
    model's shipped one if it has one, and "none" the untrained draft where the method has one. measure: a chain
    depth left unset may be timed on this machine (`s3djax.defaults`); False takes what is cached, else the data
    file's. gpu_layout: weights laid out for a GPU (`quant.lay_out_for_gpu`); None: where the backend is one."""
    if method not in BUILDERS:
        raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    opts = Options.checked(options)
    if opts.max_draft is not None and opts.max_draft < 1:
        raise UserError(f"--max-draft must be at least 1, got {opts.max_draft}")
    if opts.draft_weights is not None:
        from s3djax.speculative.draft_weights import check_mode

        check_mode(opts.draft_weights)
    ar = ARDecoder(m.config, max_cache_len, eos_ids=m.eos_ids, pad_id=m.tokenizer.pad_token_id or 0,
                   sampling=sampling, cache_dtype=opts.kv_dtype or dtype)
    if opts.draft_path is None and method != "ar":
        entry = registry.entries().get(m.name)
        opts = dataclasses.replace(opts, draft_path=entry.draft_path(method) if entry else None)
    module, _, name = BUILDERS[method].partition(":")
    built = getattr(importlib.import_module(module), name)(m, ar, opts, dtype, measure)
    if method in GIVES_WAY:
        built = giving_way(built, opts, method)
    if m.config.cpu_kernel:
        built.params = quant.pack_for_cpu(built.params)
    if jax.default_backend() == "gpu" if gpu_layout is None else gpu_layout:
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
                           sampling=sampling, dtype=dtype, measure=False, **options))

    jax.eval_shape(dry, abstract_params(source.config, DTYPES[dtype]))
    return dataclasses.replace(built[0], params=None)


def build_ar(m: LoadedModel, ar: ARDecoder, opts: Options, dtype: str, measure: bool) -> Built:
    """`--method ar`: the target alone (--skip: the whole model's plan; --target-from: a full-mode draft's target)."""
    plan = SkipPlan.parse(opts.skip, m.config.num_layers) if opts.skip else None
    params = target_from(m, opts.target_from, dtype)[0] if opts.target_from else m.params
    return Built(dataclasses.replace(ar, plan=plan), params, [])
