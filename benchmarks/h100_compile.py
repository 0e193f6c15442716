"""`python -m benchmarks.h100_compile`: every Pallas kernel and jitted step compiled for an H100 (sm_90a) on
a CPU, each case in its own process, with a report of what the compiler chose and a roofline projection.

    .venv-cuda/bin/python -m benchmarks.h100_compile --out benchmarks/results/h100-compile-DATE.md  # every case
    .venv-cuda/bin/python -m benchmarks.h100_compile --subset ci       # the cases CI compiles
    .venv-cuda/bin/python -m benchmarks.h100_compile --case NAME       # one case, its record as JSON

The compile needs jax's CUDA plugin and ptxas, which the CPU install leaves out: `make cuda-env` puts them in
.venv-cuda (the main venv's packages plus those, so a CPU user's `import jax` is unchanged). With no GPU the
target is XLA's H100 description (configs/gpu_targets/h100_sxm.txtpb) through jax's topology API; on a GPU
machine it is the device itself. Compiling runs Triton's and XLA's GPU compilers and ptxas, so shared-memory
and register limits and compiler crashes show up here; a crash (LLVM aborts the process) fails its case
alone. Without a device XLA does not autotune, so XLA's own kernels get default tilings; Pallas kernels keep
theirs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import glob
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "configs", "gpu_targets", "h100_sxm.txtpb")
CUDA_VENV = os.path.join(ROOT, ".venv-cuda")
# H100 SXM: HBM3 bandwidth and dense bf16 tensor-core peak (the figures a roofline divides by).
HBM_BYTES_PER_S = 3.35e12
PEAK_FLOPS = 989e12

KERNEL_MODELS = ("smollm2-135m", "phi-3-mini-4k", "llama-2-7b")  # head dims 64, 96 and 128
STEP_MODELS = ("smollm2-135m", "llama-2-7b")
# benchmarks.gpu_suite's variants: (weights, attention, int8 matmul).
VARIANTS = {"bf16-xla": (None, "xla", "xla"), "bf16-pallas": (None, "pallas", "xla"),
            "int8-xla": ("int8", "xla", "xla"), "int8-pallas": ("int8", "pallas", "pallas")}
# Each drafter at the settings of the CPU run whose acceptance the projection uses
# (benchmarks/results/archive/family-kernel-mt-bench-80-cpu-2026-11-24): S3D gamma 2, the others drafting one token,
# Kangaroo over its top4 tree; lookup at its default max draft, and S3D with the CPU's lookup switch. The GPU
# suite's S3D default (the paper's gamma 4, no lookup) is compiled beside them, and so is S3D drafting inside the
# verify pass at gamma 4 (25 rows a verify).
METHOD_OPTIONS = {"ar": {}, "s3d": {"gamma": 2}, "s3d-g4": {"gamma": 4}, "self-spec": {"max_draft": 1},
                  "kangaroo": {"max_draft": 1, "tree": "top4"}, "s2d": {"max_draft": 1},
                  "lookup": {"max_draft": 2}, "s3d-lookup": {"gamma": 2, "lookup": 1},
                  "s3d-inverify": {"gamma": 4, "in_verify": "on"}}
STEPS = {"ar": ("prefill", "loop", "ar-step"), "s3d-g4": ("loop",), "s3d-inverify": ("loop",)}
STEPS.update({m: ("draft", "verify", "loop") for m in METHOD_OPTIONS if m not in STEPS})
MAX_CACHE_LEN = 2048  # the GPU suite's
PROMPT = 512          # the prefill's prompt bucket
CACHES = (512, 2048, 8192)
M_ROWS = (1, 5, 16, 64, 65, 512)  # int8 matmul rows: AR, a chain, trees up to 64 nodes (+ root), a prefill
ACCEPTANCE = os.path.join(ROOT, "benchmarks", "results", "archive", "family-kernel-mt-bench-80-cpu-2026-11-24",
                          "results.json")
CASE_TIMEOUT_S = 300


# ------------------------------------------------------------------------------------------ cases

def new_tokens() -> tuple[int, ...]:
    """T per attention call: AR's 1, each chain (gamma 2 and 4, root included), the same chains with every
    node's branch of mask tokens (S3D drafting inside the verify pass) and each named tree's nodes."""
    from s3djax.speculative.tree import TreeSpec, named_trees

    return tuple(sorted({1, 3, 5, 9, 25, *(TreeSpec.from_paths(p).num_nodes for p in named_trees().values())}))


def projections(name: str) -> list[tuple[int, int]]:
    """A model's distinct linear weight shapes (K, N)."""
    import jax

    from s3djax import quant, registry
    from s3djax.model import abstract_params

    layer = abstract_params(registry.entries()[name].config())["layers_0"]
    return sorted({w.shape for path, w in jax.tree_util.tree_leaves_with_path(layer) if path[-1].key in quant.LINEARS})


def kernel_cases() -> list[str]:
    out = [f"kernel/tree-attention/{m}/T{t}/S{s}" for m in KERNEL_MODELS for t in new_tokens() for s in CACHES]
    out += [f"kernel/int8-matmul/{m}/M{r}/{k}x{n}" for m in KERNEL_MODELS for (k, n) in projections(m) for r in M_ROWS]
    return out


def step_cases() -> list[str]:
    """Every method's loop and AR's prefill in every variant at SmolLM2 shapes, and AR's and S3D's (gamma 4) at
    7B; the single steps the projection times (AR's step, each draft and verify) with XLA attention, whose
    cost analysis counts the attention too. A loop compiles its draft and verify steps inside it."""
    out = []
    for model, variant, method in itertools.product(STEP_MODELS, VARIANTS, METHOD_OPTIONS):
        for step in STEPS[method]:
            at_7b = method in ("ar", "s3d-g4", "s3d-inverify")
            if (step == "loop" and (model == "smollm2-135m" or at_7b)) or step == "prefill" or variant.endswith("-xla"):
                out.append(f"step/{model}/{variant}/{method}/{step}")
    # The 64-node tree's verify at 7B shape, the second goal the report checks (against the AR step).
    out += [f"step/llama-2-7b/{v}/s3d-tree64/verify" for v in VARIANTS]
    return out


# CI compiles a subset in under its 3 extra minutes on 2 cores: each kind of case once, at the shapes most likely
# to hit a limit. The tree-attention kernel at the widest tree over the longest cache (head dim 128) and at head
# dim 96, the int8 matmul at a prefill's and a tree's rows; a prefill; S3D's decode loop (gamma 4, int8 weights,
# both Pallas kernels) and its 64-node verify at the 7B shape. `--out` compiles every case, each method's loop too.
CI_CASES = (
    "kernel/tree-attention/llama-2-7b/T65/S8192", "kernel/tree-attention/phi-3-mini-4k/T17/S2048",
    "kernel/int8-matmul/llama-2-7b/M512/11008x4096", "kernel/int8-matmul/phi-3-mini-4k/M65/3072x8192",
    "step/smollm2-135m/bf16-pallas/ar/prefill", "step/llama-2-7b/int8-pallas/s3d-g4/loop",
    "step/llama-2-7b/bf16-pallas/s3d-tree64/verify",
)
# SmolLM2's AR decode loop at the GPU's defaults (Pallas attention, [out, in] linears, whole-loop CUDA graphs): CI
# fails above this many kernel launches a step (issue 70's goal: 10 a layer), or with any launch outside the graph.
LAUNCH_BUDGET_CASE, LAUNCH_BUDGET = "step/smollm2-135m/bf16-pallas/ar/loop", 300
# A kernel setting that cannot fit: 2048-key blocks of 128-wide bf16 keys and values in fp32 need far more
# than the 227 KiB of shared memory a block can have. CI keeps a test that this fails to compile.
BROKEN_CASE = "kernel/tree-attention/llama-2-7b/T65/S8192/block_k=2048"


def all_cases() -> list[str]:
    return kernel_cases() + step_cases()


# ------------------------------------------------------------------------------------------ building

def abstract_build(name: str, method: str, quantization: str | None, tree: str | None = "chain",
                   attention: str = "pallas", matmul: str = "pallas", **options):
    """(decoder, abstract bf16 params) of `method` on a registry model's shapes, nothing allocated: attention
    by `attention`, int8 products (quantization "int8") by `matmul`, an untrained draft, and no CPU
    kernel packing (a GPU never packs)."""
    import jax
    import jax.numpy as jnp

    from s3djax import methods, quant, registry
    from s3djax.speculative.drafters.s3d import PAPER_GAMMA
    from s3djax.loading import LoadedModel
    from s3djax.model import abstract_params

    config = dataclasses.replace(registry.entries()[name].config(), attention=attention, cpu_kernel=False)
    model = LoadedModel(name, config, None, types.SimpleNamespace(pad_token_id=0, eos_token_id=None), 0.0, matmul)
    decoders = []

    def build(params):
        if quantization:
            params = quant.apply(params, quantization, jnp.bfloat16, matmul)
        built = methods.build(method, dataclasses.replace(model, params=params), max_cache_len=MAX_CACHE_LEN,
                              dtype="bfloat16", draft_path="none",
                              # a GPU's defaults, which the CPU backend compiling here does not pick
                              **{"gamma": PAPER_GAMMA, "tree": tree, "lookup": 0, **options})
        decoders.append(built.decoder)
        return quant.lay_out_for_gpu(built.params)  # as methods.build lays weights out on a GPU

    params = jax.eval_shape(build, abstract_params(config, jnp.bfloat16))
    return decoders[0], params


def parse_case(case: str) -> tuple[list[str], dict[str, int]]:
    """A case name's fields and its `key=value` overrides (block settings)."""
    parts = case.split("/")
    return [p for p in parts if "=" not in p], {k: int(v) for k, _, v in (p.partition("=") for p in parts if "=" in p)}


def case_function(case: str):
    """(function, abstract args, donated argnums) of a case."""
    import functools

    import jax
    import jax.numpy as jnp

    from s3djax import registry

    S = jax.ShapeDtypeStruct
    fields, blocks = parse_case(case)
    if fields[0] == "kernel":
        kernel, model = fields[1], fields[2]
        c = registry.entries()[model].config()
        if kernel == "tree-attention":
            from pallas_kernels.tree_attention import tree_attention

            t, s = int(fields[3][1:]), int(fields[4][1:])
            q = S((1, t, c.num_heads, c.head_dim), jnp.bfloat16)
            cache, new = S((1, s, c.num_kv_heads, c.head_dim), jnp.bfloat16), S((1, t, c.num_kv_heads, c.head_dim), jnp.bfloat16)
            fn = functools.partial(tree_attention, backend="triton", **blocks)
            return fn, (q, cache, cache, S((1,), jnp.int32), new, new, S((1, t, t), jnp.bool_)), ()
        if kernel == "int8-matmul":
            from pallas_kernels.int8_matmul import int8_matmul

            m, (k, n) = int(fields[3][1:]), map(int, fields[4].split("x"))
            fn = functools.partial(int8_matmul, backend="triton", **blocks)
            return fn, (S((m, k), jnp.bfloat16), S((k, n), jnp.int8), S((n,), jnp.float32)), ()
        raise ValueError(case)
    _, model, variant, method, step = fields
    quantization, attention, matmul = VARIANTS[variant]
    base, options = method.split("-")[0] if method.startswith("s3d") else method, dict(METHOD_OPTIONS.get(method, {}))
    if method == "s3d-tree64":
        options = {"tree": "tree-64"}
    decoder, params = abstract_build(model, base, quantization, attention=attention, matmul=matmul, **options)
    prompt, lengths, key = S((1, PROMPT), jnp.int32), S((1,), jnp.int32), jax.eval_shape(lambda: jax.random.key(0))
    if step == "prefill":
        return decoder.start, (params, prompt, lengths, key), ()
    state = jax.eval_shape(decoder.start, params, prompt, lengths, key)
    if step == "loop":
        return decoder.decode, (params, state, S((), jnp.int32)), (1,)  # as the Runner compiles it
    from s3djax.speculative.profile import step_functions

    fn = step_functions(decoder)[{"ar-step": "ar_step_ms", "draft": "draft_step_ms", "verify": "verify_step_ms"}[step]]
    return fn, (params, (state["cache"], state.get("drafter", ())), state["length"], state["last"]), (1,)


# ------------------------------------------------------------------------------------------ compiling one case

def target_sharding():
    """A sharding on the GPU this process sees, else on the H100 target description (a compile-only device)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    try:
        return SingleDeviceSharding(jax.devices("gpu")[0]), "device"
    except RuntimeError:
        from jax.experimental import topologies

        with open(TARGET) as f:
            topology = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1")
        return NamedSharding(topologies.make_mesh(topology, (1,), ("x",)), PartitionSpec()), "target"


def on(sharding, tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


KERNEL_LINE = re.compile(r"(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+) bytes")
PTXAS = {"registers": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
         "spill_store_bytes": r"(\d+) bytes spill stores", "spill_load_bytes": r"(\d+) bytes spill loads"}
PALLAS_KERNELS = ("tree_attention", "int8_matmul", "rms_norm")
# A GEMM XLA hands to cuBLAS or cuDNN (no Triton GEMM fusion: below XLA's size threshold, or with it turned off) is a
# thunk without a kernel line.
LIBRARY_LINE = re.compile(r"^\s*\d+: (kGemm|kCublasLtMatmul|kCuDnn\w*|kConvolution\w*)\b", re.M)


def ptxas() -> str | None:
    for base in sys.path:
        found = sorted(glob.glob(os.path.join(base, "nvidia", "**", "bin", "ptxas"), recursive=True))
        if found:
            return found[0]
    return None


def kernels_from_dump(dump: str) -> list[dict]:
    """Every GPU kernel the executable launches (name, grid, threads, shared memory, from XLA's thunk
    sequence), with ptxas's registers, stack and spills for the Pallas ones."""
    out = {}
    for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
        with open(path) as f:
            text = f.read()
            for name, grid, threads, smem in KERNEL_LINE.findall(text):
                out.setdefault(name, {"name": name, "grid": grid.replace(" ", ""), "threads": threads.replace(" ", ""),
                                      "shared_bytes": int(smem), "launches": 0})["launches"] += 1
            for kind in LIBRARY_LINE.findall(text):  # a library's own kernels: at least one launch each
                library = {"name": kind, "grid": "-", "threads": "-", "shared_bytes": 0, "launches": 0}
                out.setdefault(kind, library)["launches"] += 1
    tool = ptxas()
    for path in glob.glob(os.path.join(dump, "*.ptx")):
        with open(path) as f:
            text = f.read()
        names = re.findall(r"\.entry (\w+)\(", text)
        if not tool or not any(n.startswith(PALLAS_KERNELS) for n in names):
            continue
        arch = re.search(r"\.target (\w+)", text).group(1)
        info = subprocess.run([tool, f"-arch={arch}", "-v", path, "-o", os.devnull], capture_output=True, text=True).stderr
        for name, block in zip(re.findall(r"Compiling entry function '(\w+)'", info),
                               re.split(r"Compiling entry function '\w+'", info)[1:]):
            if name in out:
                out[name].update({k: int(m.group(1)) for k, p in PTXAS.items() if (m := re.search(p, block))})
                out[name]["mma"] = sorted(set(re.findall(r"\b(wgmma|mma)\.[\w.]*?\.(tf32|bf16|f16|s8)", text)))
    return sorted(out.values(), key=lambda k: -k["shared_bytes"])


def graph_stats(dump: str) -> dict:
    """From the launch sequence after XLA's thunk passes: kernels launched outside any command buffer (CUDA graph),
    and while loops outside one, each of which copies its predicate to the host every iteration."""
    paths = glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")) or \
        glob.glob(os.path.join(dump, "*thunk_sequence.txt"))
    outside = host_loops = 0
    for path in paths:
        stack = []  # (indent, kind) of the enclosing thunks
        with open(path) as f:
            for line in f:
                m = THUNK_LINE.match(line)
                if not m:
                    continue
                indent, kind = len(m.group(1)), m.group(2)
                while stack and stack[-1][0] >= indent:
                    stack.pop()
                graphed = any(k == "kCommandBuffer" for _, k in stack)
                outside += kind in ("kCustomKernel", "kKernel", "kGemm", "kCustomCall") and not graphed
                host_loops += kind == "kWhile" and not graphed
                stack.append((indent, kind))
    return {"launches_outside_graphs": outside, "host_loops": host_loops}


THUNK_LINE = re.compile(r"^(\s*)\d+: (k\w+)")


def summarize_kernels(kernels: list[dict]) -> dict:
    """The launches and the most shared memory of all kernels; the Pallas kernels' own records."""
    return {"launches": sum(k["launches"] for k in kernels), "max_shared_bytes": max((k["shared_bytes"] for k in kernels), default=0),
            "kernels": [k for k in kernels if k["name"].startswith(PALLAS_KERNELS)]}


def cost(text: str) -> dict:
    """Flops and bytes accessed of the compiled (fused) H100 module, by XLA's cost analysis run with the
    CPU client: the compiled executable's own cost_analysis() is empty without a device. A Pallas
    kernel (a custom call) counts neither bytes nor flops, so only steps without one are projected."""
    import jax
    from jax._src.lib import xla_client
    from jaxlib import _hlo

    costs = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, _hlo.hlo_module_from_text(text))
    return {"flops": costs.get("flops", 0.0), "bytes_accessed": costs.get("bytes accessed", 0.0)}


# A linear product's GEMM split along K (XLA's default tiling for a few rows over a long K, without autotuning)
# writes f32 partial sums [splits, M, N] that a second fusion reads back and adds.
SPLIT_K = re.compile(r"^\s*%gemm_fusion[\w.]* = f32\[(\d+),(\d+),(\d+)\][^\n]*op_name=\"[^\"\n]*\.\.\.k,kn->", re.M)


def split_k_bytes(text: str) -> int:
    """Bytes of the f32 partial sums the split-K GEMMs of the model's linear products write (once each)."""
    return sum(4 * a * b * c for a, b, c in ((int(x) for x in m) for m in SPLIT_K.findall(text)))


def compile_case(case: str, with_cost: bool = False) -> dict:
    """Compiles one case for the H100 and returns its record (raises what the compiler raises)."""
    import jax

    from s3djax import compile_options

    fn, args, donate = case_function(case)
    sharding, kind = target_sharding()
    options = compile_options.for_step(args, "cuda")  # as the Runner compiles the same step
    with tempfile.TemporaryDirectory() as dump:
        start = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=donate).trace(*on(sharding, args)).lower()
        compiled = lowered.compile({"xla_dump_to": dump, **options})  # the launch sequence and the PTX, read below
        seconds = time.perf_counter() - start
        kernels = kernels_from_dump(dump)
        graphs = graph_stats(dump)
    m = compiled.memory_analysis()
    memory = {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp", "generated_code")}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    record = {"case": case, "ok": True, "seconds": round(seconds, 2), "target": kind, "memory": memory,
              **({"compiler_options": options} if options else {}), **summarize_kernels(kernels), **graphs}
    if with_cost:
        try:
            text = compiled.as_text()
            record.update(cost(text), split_k_bytes=split_k_bytes(text))
        except Exception as e:  # a jaxlib without these internals: the compile still counts, the cost is left out
            record["cost_error"] = f"{type(e).__name__}: {e}"[:300]
    return record


# ------------------------------------------------------------------------------------------ running cases

def compile_python() -> str:
    """An interpreter whose jax can compile for CUDA: this one if it has the CUDA plugin, else .venv-cuda's."""
    if any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return sys.executable
    python = os.path.join(CUDA_VENV, "bin", "python")
    if not os.path.exists(python):
        from s3djax.errors import UserError

        raise UserError("compiling for CUDA needs jax's CUDA plugin and ptxas: run `make cuda-env` (it builds .venv-cuda)")
    return python


def run_case(case: str, with_cost: bool = False, timeout_s: float = CASE_TIMEOUT_S, env: dict | None = None) -> dict:
    """Compiles `case` in a process of its own (`env`: more variables for it); a failure, a crash or a timeout
    comes back as a record with ok False and the error."""
    python = compile_python()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, **(env or {}))
    if python != sys.executable or "JAX_PLATFORMS" in os.environ:
        env["JAX_PLATFORMS"] = "cpu"  # no GPU here: keeps the plugin from looking for a driver
    argv = [python, "-m", "benchmarks.h100_compile", "--case", case] + (["--cost"] if with_cost else [])
    start = time.perf_counter()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"case": case, "ok": False, "error": f"timed out at {timeout_s:.0f} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line for line in r.stderr.strip().splitlines() if line.strip()][-12:]
    error = next((line for line in reversed(tail) if re.search(r"Error|error:|LLVM ERROR|Aborted", line)), tail[-1] if tail else "")
    return {"case": case, "ok": False, "returncode": r.returncode, "error": error.strip()[:600],
            "seconds": round(time.perf_counter() - start, 1), "stderr_tail": "\n".join(tail)[-3000:]}


def run_cases(cases, jobs: int, with_cost: bool = False, save=None) -> list[dict]:
    """Each case's record, in order; `save(records so far)` after each, so a cut-off run keeps them."""
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_case, c, with_cost) for c in cases]
        records = []
        for i, f in enumerate(futures, 1):
            records.append(r := f.result())
            print(f"[{i}/{len(cases)}] {r['case']}: {'ok' if r['ok'] else 'FAILED: ' + r['error']} "
                  f"({r.get('seconds', '-')} s)", file=sys.stderr, flush=True)
            if save:
                save(records)
    return records


# ------------------------------------------------------------------------------------------ the report

def gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def has_roofline(variant: str) -> bool:
    """Whether a variant's steps can be projected: XLA's attention and products, which its cost analysis counts."""
    return VARIANTS[variant][1:] == ("xla", "xla")


def roofline_ms(r: dict) -> tuple[float, float]:
    return r["bytes_accessed"] / HBM_BYTES_PER_S * 1e3, r["flops"] / PEAK_FLOPS * 1e3


def step_index(records) -> dict:
    out = {}
    for r in records:
        fields, _ = parse_case(r["case"])
        if fields[0] == "step" and r["ok"]:
            out[tuple(fields[1:])] = r
    return out


def acceptance(path: str) -> dict:
    with open(path) as f:
        bench = json.load(f)
    (dataset, methods), = list(bench["summary"].items())[:1]
    return {m: v["tau"] for m, v in methods.items() if v.get("tau")} | {"_about": f"{dataset}, {bench['device']}"}


def checks(steps: dict) -> list[str]:
    out = ["## Checks", ""]
    for model, variant in itertools.product(STEP_MODELS, VARIANTS):
        ar, s3d = steps.get((model, variant, "ar", "loop")), steps.get((model, variant, "s3d-g4", "loop"))
        if not (ar and s3d):
            out.append(f"- peak memory, {model} {variant}: not compiled")
            continue
        ratio = s3d["memory"]["peak"] / ar["memory"]["peak"]
        verdict = "PASS" if ratio <= 1.05 else "FAIL"
        line = (f"- {verdict}: S3D's peak memory (decode loop, gamma 4) is {ratio:.3f}x AR's, {model} {variant} "
                f"({gib(s3d['memory']['peak'])} vs {gib(ar['memory']['peak'])} GiB; goal 1.05x)")
        if verdict == "FAIL":
            line += ("; cause: " + ", ".join(f"{k} {mib(s3d['memory'][k] - ar['memory'][k])} MiB more"
                                             for k in ("argument", "output", "temp") if s3d["memory"][k] != ar["memory"][k]))
        out.append(line)
    for variant in VARIANTS:
        if not has_roofline(variant):
            out.append(f"- not projected, {variant}: XLA's cost analysis counts neither bytes nor flops for a Pallas kernel "
                       "(a custom call), so a step that runs one has no roofline; the -xla variants project the same "
                       "products and attention")
            continue
        ar, tree = steps.get(("llama-2-7b", variant, "ar", "ar-step")), steps.get(("llama-2-7b", variant, "s3d-tree64", "verify"))
        if not (ar and tree and "flops" in ar and "flops" in tree):
            out.append(f"- 64-node verify, llama-2-7b {variant}: not compiled")
            continue
        ta, tt = max(roofline_ms(ar)), max(roofline_ms(tree))
        verdict = "PASS" if tt <= 1.3 * ta else "FAIL"
        line = (f"- {verdict}: a 64-node verify at the 7B shape is projected at {tt / ta:.2f}x an AR step, {variant} "
                f"({tt:.2f} vs {ta:.2f} ms; goal 1.3x)")
        if verdict == "FAIL":
            bt, ft = roofline_ms(tree)
            line += (f"; cause: bytes {tree['bytes_accessed'] / 1e9:.2f} GB vs AR's {ar['bytes_accessed'] / 1e9:.2f} GB "
                     f"({bt:.2f} ms), flops {tree['flops'] / 1e12:.2f} T ({ft:.2f} ms)")
            if "split_k_bytes" in tree and "split_k_bytes" in ar:
                def unsplit(r):  # the partial sums are written, then read back: twice in bytes accessed
                    return max(roofline_ms(dict(r, bytes_accessed=r["bytes_accessed"] - 2 * r["split_k_bytes"])))

                line += (f"; {2 * tree['split_k_bytes'] / 1e9:.2f} GB of the verify's bytes are split-K partial sums of "
                         "its 65-row products, f32, written and read back, under XLA's default GEMM tilings (no "
                         f"autotuning without a device); without them {unsplit(tree) / unsplit(ar):.2f}x")
        out.append(line)
    return out + [""]


def report(records: list[dict], taus: dict, seconds: float, not_run: list[str] = ()) -> str:
    import jax

    ok = sum(r["ok"] for r in records)
    lines = [f"# Compiled for an H100 (sm_90a) without a GPU: {ok} of {len(records)} cases", "",
             f"- date {datetime.date.today().isoformat()}; jax {jax.__version__}; target configs/gpu_targets/h100_sxm.txtpb "
             f"(no device: XLA does not autotune, so its own kernels have default tilings); the compiles took "
             f"{seconds / 60:.1f} min together, on a {os.cpu_count()}-core CPU", f"- regenerate: `.venv-cuda/bin/python -m benchmarks.h100_compile --out THIS_FILE`",
             f"- steps: bf16 weights (int8: per-channel int8), bf16 cache of {MAX_CACHE_LEN} slots (+ the method's slack), "
             f"a {PROMPT}-token prefill bucket, untrained drafts; methods at their measured CPU settings "
             "(s3d gamma 2, self-spec/kangaroo/s2d one draft token, kangaroo's top4 tree, lookup max draft 2); s3d-g4 is "
             "the GPU suite's S3D default (gamma 4), s3d-tree64 S3D's verify over configs/trees/tree-64.yaml, s3d-lookup "
             "S3D giving way to prompt lookup (`--lookup 1`, the CPU default)",
             "- int8-xla steps compile with `xla_gpu_dot_merger_threshold_mb=0`, as the Runner compiles them "
             "(`s3djax.quant.compiler_options`): XLA's dot merging would convert each int8 weight of a merged product "
             "into a bf16 buffer, which a loop body's draft and verification then share, live from one to the other", ""]
    if not_run:
        lines += [f"Not compiled in this run ({len(not_run)} cases; `--resume` compiles them): "
                  + ", ".join(f"`{c}`" for c in not_run), ""]
    failed = [r for r in records if not r["ok"]]
    lines += ["## Failures", ""] + ([f"- `{r['case']}`: {r['error']}" for r in failed] or ["- none"]) + [""]
    steps = step_index(records)
    lines += checks(steps)

    lines += ["## Pallas kernels", "", "Registers, stack and spills from ptxas -v (sm_90a) on the PTX XLA's Triton "
              "pipeline made; grid, threads and shared memory from the executable's launch sequence; mma: the tensor-core "
              "instructions in the PTX.", "",
              "| case | compile s | grid | threads | shared KiB | registers | stack B | spills st/ld B | mma |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r["ok"] and r["case"].startswith("kernel/"):
            for k in r["kernels"]:
                if k["name"].startswith(PALLAS_KERNELS):
                    lines.append(f"| {r['case'][7:]} | {r['seconds']} | {k['grid']} | {k['threads']} | "
                                 f"{k['shared_bytes'] / 1024:.0f} | {k.get('registers', '-')} | {k.get('stack_bytes', '-')} | "
                                 f"{k.get('spill_store_bytes', '-')}/{k.get('spill_load_bytes', '-')} | "
                                 f"{' '.join('.'.join(x) for x in k.get('mma', [])) or '-'} |")
    lines += ["", "## Steps", "",
              "Memory from compiled.memory_analysis() for the H100 (peak = argument + output - alias + temp); flops "
              "and bytes from XLA's cost analysis of the compiled, fused H100 module (a Pallas kernel, a custom call, "
              "counts neither, so steps with one are not projected; a loop counts its body once; jit drops unused "
              "arguments, so a draft step's argument bytes are the layers it reads). Roofline: "
              f"bytes / {HBM_BYTES_PER_S / 1e12:.2f} TB/s and flops / {PEAK_FLOPS / 1e12:.0f} TFLOP/s (bf16 dense); "
              "**a projection, not a measurement**.", "",
              "| model | variant | method | step | compile s | argument GiB | output GiB | alias GiB | temp MiB | peak GiB | "
              "kernel launches | outside graphs | host loops | max shared KiB | GFLOP | GB accessed | "
              "projected ms (bytes / flops) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (model, variant, method, step), r in steps.items():
        m = r["memory"]
        proj = "-"
        if "flops" in r and step != "loop" and has_roofline(variant):
            b, f = roofline_ms(r)
            proj = f"{max(b, f):.3f} ({b:.3f} / {f:.3f})"
        lines.append(f"| {model} | {variant} | {method} | {step} | {r['seconds']} | {gib(m['argument'])} | {gib(m['output'])} | "
                     f"{gib(m['alias'])} | {mib(m['temp'])} | {gib(m['peak'])} | {r['launches']} | "
                     f"{r.get('launches_outside_graphs', '-')} | {r.get('host_loops', '-')} | {r['max_shared_bytes'] / 1024:.0f} | "
                     f"{r.get('flops', 0) / 1e9:.2f} | {r.get('bytes_accessed', 0) / 1e9:.3f} | {proj} |")
    lines += ["", "## Projected speed of each method on an H100", "",
              f"PROJECTION: tokens/s = tau / (draft ms + verify ms) with the roofline step times above and tau measured "
              f"on the CPU with SmolLM2's shipped drafts ({taus['_about']}; {os.path.relpath(ACCEPTANCE, ROOT)}); AR = 1 / "
              "AR step. At the 7B shape tau is SmolLM2's: a 7B model's own drafts would accept differently. Per-step "
              "overheads (launches, the loop's host-free bookkeeping) are not in a roofline.", "",
              "| model | variant | method | tau | draft ms | verify ms (ar: its step) | projected tokens/s | projected speed-up |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, variant in itertools.product(STEP_MODELS, VARIANTS):
        ar = steps.get((model, variant, "ar", "ar-step"))
        if not ar or "flops" not in ar:
            continue
        ar_tps = 1e3 / max(roofline_ms(ar))
        lines.append(f"| {model} | {variant} | ar | 1.00 | - | {max(roofline_ms(ar)):.3f} | {ar_tps:.0f} | 1.00x |")
        for method in ("s3d", "self-spec", "kangaroo", "s2d", "lookup"):
            d, v = steps.get((model, variant, method, "draft")), steps.get((model, variant, method, "verify"))
            if not (d and v and method in taus):
                continue
            dm, vm = max(roofline_ms(d)), max(roofline_ms(v))
            tps = taus[method] * 1e3 / (dm + vm)
            lines.append(f"| {model} | {variant} | {method} | {taus[method]:.2f} | {dm:.3f} | {vm:.3f} | {tps:.0f} | "
                         f"{tps / ar_tps:.2f}x |")
    lines += ["", "## Launch-bound projection", "",
              "PROJECTION where a step costs its launches (SmolLM2 on a Hopper GPU: 0.27 GB of weights take 0.08 ms, a "
              "launch a few µs): one iteration of a method's decode loop (one verify step) against one of AR's, speed-up "
              "= tau x AR loop launches / the method's loop launches, with the same tau as above. Launches inside one "
              "CUDA graph are assumed to cost alike, whatever the kernel.", "",
              "| model | variant | method | loop launches | outside graphs | host loops | tau | projected speed-up |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, variant in itertools.product(STEP_MODELS, VARIANTS):
        ar = steps.get((model, variant, "ar", "loop"))
        if not ar:
            continue
        for method in METHOD_OPTIONS:
            r = steps.get((model, variant, method, "loop"))
            if not r:
                continue
            tau = 1.0 if method == "ar" else taus.get(method)
            up = "-" if tau is None else f"{tau * ar['launches'] / r['launches']:.2f}x"
            lines.append(f"| {model} | {variant} | {method} | {r['launches']} | {r.get('launches_outside_graphs', '-')} | "
                         f"{r.get('host_loops', '-')} | {'-' if tau is None else f'{tau:.2f}'} | {up} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    from s3djax.cli import Parser, run  # noqa: F401  (run wraps main below)

    p = Parser(prog="python -m benchmarks.h100_compile", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--case", help="compile one case in this process and print its record as JSON")
    p.add_argument("--cost", action="store_true", help="with --case: add flops and bytes accessed")
    p.add_argument("--subset", choices=("all", "ci", "kernels", "steps"), default="all")
    p.add_argument("--only", default="", help="a regular expression the case names must match")
    p.add_argument("--jobs", type=int, default=2, help="cases compiled at once, each in its own process")
    p.add_argument("--out", help="write the report (markdown) here, and the records beside it as .json")
    p.add_argument("--resume", action="store_true", help="keep the compiled records in --out's .json; compile the rest")
    p.add_argument("--list", action="store_true", help="print the case names and stop")
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(compile_case(args.case, args.cost)))
        return
    cases = {"all": all_cases, "ci": lambda: list(CI_CASES), "kernels": kernel_cases, "steps": step_cases}[args.subset]()
    cases = [c for c in cases if re.search(args.only, c)]
    if args.list:
        print("\n".join(cases))
        return
    start, kept = time.time(), {}
    saved = os.path.splitext(args.out)[0] + ".json" if args.out else None
    if args.resume and saved and os.path.exists(saved):
        with open(saved) as f:
            kept = {r["case"]: r for r in json.load(f)["records"] if r["ok"]}

    def save(done):
        with open(saved, "w") as f:
            json.dump({"records": [*kept.values(), *done]}, f, indent=1)

    done = run_cases([c for c in cases if c not in kept], args.jobs, with_cost=bool(args.out), save=save if saved else None)
    records = sorted([*kept.values(), *done], key=lambda r: cases.index(r["case"]) if r["case"] in cases else -1)
    failed = [r for r in records if not r["ok"]]
    print(f"{len(records) - len(failed)} of {len(records)} cases compiled for the H100 in {time.time() - start:.0f} s",
          file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report(records, acceptance(ACCEPTANCE), sum(r.get("seconds", 0) for r in records),
                           [c for c in all_cases() if c not in {r["case"] for r in records}]))
        print(f"wrote {args.out}", file=sys.stderr)
    if failed:
        from s3djax.errors import UserError

        raise UserError(f"{len(failed)} cases failed to compile: " + "; ".join(r["case"] for r in failed))


if __name__ == "__main__":
    from s3djax.cli import run

    run(main)
