"""The XLA options every decode step is compiled with, wherever one is compiled (`decode.Runner`, step timing,
`benchmarks.h100_compile`): one place, so a timing and the Runner compile the same program."""

from __future__ import annotations

import os

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


def for_step(params) -> dict:
    buffers = os.environ.get(ENV, COMMAND_BUFFERS)
    # A decode loop is one while thunk, and XLA forms no graph of fewer thunks than its minimum (5): without this,
    # WHILE turns a loop whose body was a graph into one with no graph at all.
    smallest = {"xla_gpu_graph_min_graph_size": 1} if "WHILE" in buffers.split(",") else {}
    return {"xla_gpu_enable_command_buffer": buffers, **smallest, **quant.compiler_options(params)}
