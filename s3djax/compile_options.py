"""The XLA options every decode step is compiled with, wherever one is compiled (`decode.Runner`, step timing,
`benchmarks.h100_compile`): one place, so a timing and the Runner compile the same program."""

from __future__ import annotations

import functools
import os
import re

import jax

from s3djax import quant

# XLA's command buffers (CUDA graphs) by default stop at a while loop, and a while loop whose trip count is
# data-dependent copies its predicate to the host every iteration. With WHILE captured (CUDA's conditional graph
# nodes), a whole decode call runs as one graph with no host round trip (docs/gpu-compile.md). The rest is XLA's
# default list. Other platforms ignore the option.
XLA_DEFAULT = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"
COMMAND_BUFFERS = XLA_DEFAULT + ",WHILE"
# S3DJAX_COMMAND_BUFFERS replaces the list (XLA's names, comma-separated; empty: none), to measure or to step
# around a driver that cannot run conditional nodes.
ENV = "S3DJAX_COMMAND_BUFFERS"
# S3DJAX_XLA_OPTIONS adds XLA options to every step's ("name=value name=value"): for a GPU lease or the H100 compile
# to try one against the defaults (benchmarks.gpu_steps's settings, benchmarks.h100_compile's run_case).
OPTIONS_ENV = "S3DJAX_XLA_OPTIONS"


def for_step(params, platform: str | None = None) -> dict:
    """The options for a step over `params` compiled for `platform` (default: the default backend's)."""
    buffers = os.environ.get(ENV, COMMAND_BUFFERS)
    # A decode loop is one while thunk, and XLA forms no graph of fewer thunks than its minimum (5): without this,
    # WHILE turns a loop whose body was a graph into one with no graph at all.
    smallest = {"xla_gpu_graph_min_graph_size": 1} if "WHILE" in buffers.split(",") else {}
    return {"xla_gpu_enable_command_buffer": buffers, **smallest, **quant.compiler_options(params),
            **exact_rounding(platform or jax.default_backend()), **extra_options(os.environ.get(OPTIONS_ENV, ""))}


@functools.cache
def extra_options(text: str) -> dict:
    """`name=value` pairs, space-separated, as XLA options: integers and true / false as such, the rest as text.
    XLA checks the names and values once, on a trivial program (its options are the same for every backend)."""
    from s3djax.errors import UserError

    out = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not (sep and value and name.startswith("xla_")):
            raise UserError(f"{OPTIONS_ENV} takes XLA options as name=value pairs, space-separated; got {item!r}")
        number = re.fullmatch(r"-?\d+", value)
        out[name] = {"true": True, "false": False}.get(value.lower(), int(value) if number else value)
    if out:
        try:
            jax.jit(lambda x: x + 1).lower(0.0).compile(out)
        except jax.errors.JaxRuntimeError as e:
            raise UserError(f"{OPTIONS_ENV}: {str(e).splitlines()[0]}") from None
    return out


def exact_rounding(platform: str) -> dict:
    """On the CPU, every bfloat16 value rounded where the program says: by default XLA may keep a fused bfloat16
    intermediate in fp32, so a layer's output rounds or not by how the step around it fused, and Kangaroo's verify,
    which resumes from the exit states its drafts stored, left greedy `ar`'s tokens in bfloat16 on 11 of 20 MT-Bench
    answers (docs/kernels.md#bfloat16-pairs). A GPU's products round by their tiling anyway (docs/gpu.md)."""
    return {"xla_allow_excess_precision": False} if platform == "cpu" else {}
