"""Kernels and jitted steps compile for an H100 (sm_90a) on this CPU, each case in its own process
(benchmarks.h100_compile), so a GPU run meets no compile error; a kernel setting that cannot fit fails.

CI compiles `CI_CASES`, a subset that fits its budget; `python -m benchmarks.h100_compile --out FILE`
compiles every case and writes the report. The compiler lives in .venv-cuda (`make cuda-env`, which
`make test` runs); without it these tests skip, except under CI, where they fail.
"""

import os

import pytest

from benchmarks import h100_compile
from s3djax import compile_options
from s3djax.errors import UserError


@pytest.fixture(scope="module")
def compiler():
    try:
        return h100_compile.compile_python()
    except UserError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.mark.parametrize("case", h100_compile.CI_CASES)
def test_compiles_for_the_h100(compiler, case):
    r = h100_compile.run_case(case)
    assert r["ok"], f"{case}: {r['error']}\n{r.get('stderr_tail', '')}"
    memory, kernels = r["memory"], {k["name"]: k for k in r["kernels"]}
    assert memory["argument"] > 0 and memory["peak"] >= memory["argument"] - memory["alias"]
    fields, _ = h100_compile.parse_case(case)
    pallas = fields[1].replace("-", "_") if fields[0] == "kernel" else "tree_attention" if "pallas" in fields[2] and fields[-1] != "prefill" else None
    if pallas:  # (a prefill's dense mask stays on XLA's attention) the Pallas kernel went through Triton and ptxas for sm_90a, within the H100's limits (spills
        k = kernels[pallas]  # are allowed: the report lists them)
        assert 0 < k["registers"] <= 255 and 0 < k["shared_bytes"] <= 232448


def test_the_smollm2_decode_loop_runs_as_one_graph_within_its_launch_budget(compiler):
    r = h100_compile.run_case(h100_compile.LAUNCH_BUDGET_CASE)
    assert r["ok"], r.get("error")
    # every kernel inside the one CUDA graph: no launch from the host, no predicate copied to it a step
    assert r["launches_outside_graphs"] == 0 and r["host_loops"] == 0, r
    assert r["launches"] <= h100_compile.LAUNCH_BUDGET, r["launches"]
    # and with XLA's own list of graph commands, the loop is left to the host (what the option is for)
    plain = h100_compile.run_case(h100_compile.LAUNCH_BUDGET_CASE, env={compile_options.ENV: compile_options.XLA_DEFAULT})
    assert plain["host_loops"] == 1


def test_a_kernel_setting_that_overflows_shared_memory_fails_to_compile(compiler):
    # Lowering accepts it (Pallas checks shapes, not the GPU's limits): only the compile can catch it.
    r = h100_compile.run_case(h100_compile.BROKEN_CASE)
    assert not r["ok"]
    assert "RESOURCE_EXHAUSTED" in r["error"] or "shared memory" in r["error"], r


def test_the_report_checks_memory_and_the_64_node_verify():
    def step(case, peak, flops=0.0, bytes_accessed=0.0):
        return {"case": case, "ok": True, "seconds": 1.0, "kernels": [], "launches": 1, "max_shared_bytes": 0, "flops": flops, "bytes_accessed": bytes_accessed,
                "memory": {"argument": peak, "output": 0, "alias": 0, "temp": 0, "generated_code": 0, "peak": peak}}

    records = [step("step/llama-2-7b/bf16-xla/ar/loop", 100), step("step/llama-2-7b/bf16-xla/s3d-g4/loop", 110),
               step("step/llama-2-7b/bf16-xla/ar/ar-step", 100, 1e9, 13e9),
               step("step/llama-2-7b/bf16-xla/s3d-tree64/verify", 100, 9e11, 13.5e9),
               {"case": "kernel/tree-attention/llama-2-7b/T65/S8192", "ok": False, "error": "RESOURCE_EXHAUSTED: shared memory"},
               step("step/llama-2-7b/int8-xla/ar/ar-step", 100, 1e9, 10e9) | {"split_k_bytes": 0},
               step("step/llama-2-7b/int8-xla/s3d-tree64/verify", 100, 9e11, 15e9) | {"split_k_bytes": 2e9}]
    text = h100_compile.report(records, {"_about": "test"}, 1.0)
    assert "FAIL: S3D's peak memory (decode loop, gamma 4) is 1.100x AR's, llama-2-7b bf16-xla" in text
    assert "argument 0.0 MiB more" in text
    assert "PASS: a 64-node verify at the 7B shape is projected at 1.04x an AR step, bf16-xla" in text
    assert "FAIL: a 64-node verify at the 7B shape is projected at 1.50x an AR step, int8-xla" in text
    assert "4.00 GB of the verify's bytes are split-K partial sums" in text and "without them 1.10x" in text
    assert "- `kernel/tree-attention/llama-2-7b/T65/S8192`: RESOURCE_EXHAUSTED" in text
    assert "- not projected, int8-pallas: XLA's cost analysis counts neither bytes nor flops for a Pallas kernel" in text


def test_int8_products_on_xla_compile_without_dot_merging():
    # XLA's DotMerger joins q/k/v and gate/up into one GEMM that cannot fuse the int8 -> bf16 converts; a loop
    # body's draft and verification then share the converted copies, live from one to the other (S3D's peak
    # 1.34x AR's at the 7B shape, int8-xla). The Runner, step timing and these compiles turn it off for them.
    import jax.numpy as jnp

    from s3djax import quant

    w = jnp.ones((8, 8), jnp.float32)
    xla, pallas = quant.linear(w, "int8", jnp.bfloat16), quant.linear(w, "int8", jnp.bfloat16, "pallas")
    assert quant.compiler_options(({"layers_0": {"q": xla}, "embed": w}, {})) == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert quant.compiler_options({"layers_0": {"q": pallas}}) == quant.compiler_options({"layers_0": {"q": w}}) == {}


def test_more_xla_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(compile_options.OPTIONS_ENV, "xla_gpu_experimental_force_split_k=1"
                       " xla_gpu_enable_triton_gemm=false xla_gpu_enable_command_buffer=FUSION,CUBLAS")
    options = compile_options.for_step({}, "cuda")
    assert options["xla_gpu_experimental_force_split_k"] == 1 and options["xla_gpu_enable_triton_gemm"] is False
    assert options["xla_gpu_enable_command_buffer"] == "FUSION,CUBLAS"  # given, it replaces the default list
    # XLA checks the names and the values: each refusal is one line naming the variable.
    for bad, why in (("xla_no_such_option=1", "No such compile option"), ("xla_gpu_experimental_force_split_k=--1",
                                                                          "not a valid int32")):
        with pytest.raises(UserError, match=f"{compile_options.OPTIONS_ENV}: .*{why}"):
            compile_options.extra_options(bad)
    monkeypatch.setenv(compile_options.OPTIONS_ENV, "force_split_k=1")
    with pytest.raises(UserError, match="takes XLA options as name=value pairs"):
        compile_options.for_step({}, "cuda")


def test_the_7b_loop_without_split_k_sums_and_a_cublas_gemm_counted_as_a_launch(compiler):
    # Without a device XLA splits the o and down GEMMs along K for one row (397 launches, each split-K sum a kernel
    # of its own); unsplit, those sums are gone. With Triton's GEMMs off, cuBLAS runs the products: the report's
    # count takes each of its calls as a launch, though no kernel line names it.
    case = "step/llama-2-7b/bf16-pallas/ar/loop"
    unsplit = h100_compile.run_case(case, env={compile_options.OPTIONS_ENV: "xla_gpu_experimental_force_split_k=1"})
    cublas = h100_compile.run_case(case, env={compile_options.OPTIONS_ENV: "xla_gpu_enable_triton_gemm=false"})
    assert unsplit["ok"] and cublas["ok"], (unsplit.get("error"), cublas.get("error"))
    assert unsplit["launches"] <= 333 and unsplit["compiler_options"]["xla_gpu_experimental_force_split_k"] == 1
    assert abs(cublas["launches"] - unsplit["launches"]) <= 2, (cublas["launches"], unsplit["launches"])
