"""`python -m benchmarks.gpu_steps`: AR decoding and S3D's steps under each of issue 70's settings (weight layout,
attention, command buffers), at SmolLM2's shape and Llama-2-7B's, with random weights made on the device.

    python -m benchmarks.gpu_steps --out DIR [--deadline-s 480] [--only NAME,...]
    python -m benchmarks.gpu_steps --quick --out DIR     # a CPU check of the script: small shapes, few tokens

Random weights need no file, so one short GPU call measures every setting; a step's time does not depend on
the values. Each setting runs in a process of its own (a command-buffer crash ends it alone), in priority order,
and none starts past the deadline. `DIR/gpu_steps.jsonl` gets a record per setting as it finishes, and
`DIR/gpu_steps-DEVICE.md` the table. S3D's speed is projected from its measured draft and verify steps and the
acceptance its shipped draft reached on MT-Bench 80 on the CPU (`ACCEPTANCE`): tau / (draft + verify) against
1 / AR step.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import types

from s3djax.cli import Parser, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCEPTANCE = os.path.join(ROOT, "benchmarks", "results", "archive",
                          "family-zen4-kept-layers-mt-bench-80-humaneval-40-cpu-2026-11-28", "results.json")


@dataclasses.dataclass(frozen=True)
class Setting:
    model: str
    attention: str            # "xla" or "pallas"
    transposed: bool          # linears laid out [out, in], q/k/v joined (quant.lay_out_for_gpu)
    graphs: bool              # WHILE and CONDITIONAL in command buffers (compile_options.COMMAND_BUFFERS)
    quant: str = "none"
    s3d: bool = False         # also S3D's draft and verify steps, and the 64-node tree's verify
    alone: int | None = None  # pallas_kernels.tree_attention.ALONE (0: split every cache, as before 2026-11-29)
    xla: str = ""             # more XLA options for every step (compile_options.OPTIONS_ENV)

    def about(self) -> str:
        return (f"{self.attention} attention, {'[out, in] linears, q/k/v joined' if self.transposed else '[in, out] linears'}, "
                f"{'whole-loop graphs' if self.graphs else 'XLA default graphs'}"
                + (f", {self.quant} weights" if self.quant != "none" else "")
                + (f", attention split past {self.alone} keys x head dim" if self.alone is not None else "")
                + (f", XLA options {self.xla}" if self.xla else ""))


# In priority order: the new defaults first, then what the first lease ran, then one change at a time.
SETTINGS = {
    "smollm2/new": Setting("smollm2-135m", "pallas", True, True, s3d=True),
    "smollm2/lease1": Setting("smollm2-135m", "xla", False, False),
    "7b/new": Setting("llama-2-7b", "pallas", True, True, s3d=True),
    "7b/lease1": Setting("llama-2-7b", "xla", False, False),
    "smollm2/split": Setting("smollm2-135m", "pallas", True, True, alone=0),
    "smollm2/xla-transposed": Setting("smollm2-135m", "xla", True, False),
    "smollm2/pallas-transposed": Setting("smollm2-135m", "pallas", True, False),
    "smollm2/xla-transposed-graphs": Setting("smollm2-135m", "xla", True, True),
    "smollm2/pallas-graphs": Setting("smollm2-135m", "pallas", False, True),
    "7b/int8": Setting("llama-2-7b", "pallas", True, True, quant="int8"),
    # Compiled without a device, XLA splits the o and down GEMMs along K for one row, each split-K sum a launch of its
    # own (docs/gpu-compile.md): whether the unsplit GEMMs read the weights as fast, only a GPU says.
    "7b/split-k-1": Setting("llama-2-7b", "pallas", True, True, xla="xla_gpu_experimental_force_split_k=1"),
}
SETTING_LIMIT_S = 180  # a setting that hangs (a graph that never returns) loses this much of the call, not all of it


def measure(name: str, quick: bool, context: int, new_tokens: int, emit) -> None:
    """One setting's record, `emit`ted as it grows (a hang later keeps what came before): AR decode ms a token
    (prefill excluded) and the tokens, the kernel profile, and S3D's step times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from s3djax import compile_options, methods, model, quant, registry
    from s3djax.speculative.drafters.s3d import PAPER_GAMMA
    from s3djax.decode import Runner
    from s3djax.loading import LoadedModel
    from s3djax.speculative import tree as trees
    from s3djax.speculative.profile import step_times

    s = SETTINGS[name]
    if s.alone is not None:
        from pallas_kernels import tree_attention

        tree_attention.ALONE = s.alone
    os.environ[compile_options.ENV] = compile_options.COMMAND_BUFFERS if s.graphs else compile_options.XLA_DEFAULT
    os.environ[compile_options.OPTIONS_ENV] = f"{os.environ.get(compile_options.OPTIONS_ENV, '')} {s.xla}".strip()
    config = dataclasses.replace(registry.entries()[s.model].config(), attention=s.attention, cpu_kernel=False)
    if quick:
        config = dataclasses.replace(config, num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4,
                                     num_kv_heads=2, head_dim=32, vocab_size=4096)
    t = time.perf_counter()
    params = model.random_params(config, jax.random.key(0))
    if s.quant != "none":
        params = quant.apply(params, s.quant, jnp.bfloat16, "pallas")
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=None)
    loaded = LoadedModel(s.model, config, params, tokenizer, 0.0, "pallas")
    max_cache = 2048

    def build(method, **options):
        # Without the GPU layout, methods.build keeps the weights as loaded: [in, out], q, k and v apart.
        return methods.build(method, loaded, max_cache_len=max_cache, dtype="bfloat16", gpu_layout=s.transposed,
                             **({"draft_path": "none"} if quick else {}), **options)

    ar = build("ar")
    laid_out = any(isinstance(w, quant.Transposed) for w in jax.tree.leaves(ar.params, is_leaf=quant.is_weight))
    init_s = time.perf_counter() - t
    prompt = np.random.default_rng(0).integers(100, config.vocab_size, context).tolist()
    runner = Runner(ar.decoder, ar.params)
    compile_s = runner.generate(prompt, new_tokens).compile_s  # compiles and warms
    runs = [runner.generate(prompt, new_tokens) for _ in range(3)]
    best = min(runs, key=lambda r: r.decode_s)
    steps = len(best.tokens) - 1  # the first token comes from the prefill
    record = {"setting": name, "about": s.about(), "model": s.model, "device": jax.devices()[0].device_kind,
              "jax": jax.__version__, "transposed_in_params": laid_out, "init_s": round(init_s, 1),
              "compile_s": round(compile_s, 2), "ttft_ms": round(best.ttft_s * 1e3, 2),
              "ar_ms": best.decode_s / steps * 1e3, "ar_tokens_per_s": steps / best.decode_s,
              "tokens": best.tokens, "weight_bytes": quant.param_bytes(ar.params)}
    emit(record)
    if PROFILE_STEPS and s.model == "smollm2-135m":
        try:
            record["profile"] = kernel_profile(lambda: runner.generate(prompt, PROFILE_STEPS + 1), PROFILE_STEPS)
        except Exception as e:  # the profiler is a diagnosis: the timing stands without it
            record["profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    if s.s3d:
        s3d = build("s3d", gamma=PAPER_GAMMA, lookup=0)
        state = Runner(s3d.decoder, s3d.params).prefill(prompt)
        named = {"verify": trees.TreeSpec.chain(PAPER_GAMMA), "tree64": trees.resolve("tree-64", PAPER_GAMMA)}
        record["s3d"] = step_times(s3d.decoder, s3d.params, state, trees=named, repeats=3 if quick else 20)
        record["s3d_kept_layers"] = sum(a or m for a, m in zip(s3d.decoder.drafter.plan.attn, s3d.decoder.drafter.plan.mlp))
    emit(record)


PROFILE_STEPS = 16


def kernel_profile(run, steps: int) -> dict:
    """The device's kernels while `run()` decodes `steps` tokens, from JAX's profiler (its Perfetto trace): kernels
    and their summed time a step, the device's busy span a step, and the kernels that took the most time."""
    import collections
    import glob
    import gzip
    import re
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        with gzip.open(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in e["args"]["name"]}
    kernels = [e for e in events if e.get("ph") == "X" and e["pid"] in devices]
    if not kernels:
        return {"kernels": 0}
    by_name = collections.Counter()
    for e in kernels:
        by_name[re.sub(r"[._]\d+$", "", e["name"])] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    return {"kernels_per_step": len(kernels) / steps, "kernel_us_per_step": sum(e["dur"] for e in kernels) / steps,
            "span_us_per_step": span / steps, "top_us_per_step": {k: v / steps for k, v in by_name.most_common(12)}}


def tau() -> float | None:
    try:
        with open(ACCEPTANCE) as f:
            return json.load(f)["summary"]["mt-bench"]["s3d"]["tau"]
    except (OSError, KeyError, ValueError):
        return None


def table(records: list[dict], copy_bw: float | None) -> str:
    t = tau()
    base = {r["model"]: r for r in records if r["setting"].endswith("/lease1") and "error" not in r}
    rows = []
    for r in records:
        if "error" in r:
            rows.append(f"| {r['setting']} | {SETTINGS[r['setting']].about()} | failed: {r['error'][:120]} | | | | | |")
            continue
        b = base.get(r["model"])
        same = "-" if b is None or b is r else f"{sum(x == y for x, y in zip(r['tokens'], b['tokens'])) / len(b['tokens']):.0%}"
        floor = r["weight_bytes"] / copy_bw * 1e3 if copy_bw else None
        s3d = r.get("s3d")
        projected = "-"
        if s3d and t:
            projected = (f"draft {s3d['draft_step_ms']:.3f} + verify {s3d['verify_step_ms']:.3f} ms: "
                         f"{t / (s3d['draft_step_ms'] + s3d['verify_step_ms']) * s3d['ar_step_ms']:.2f}x; "
                         f"tree-64 verify {s3d['verify_tree64_ms'] / s3d['ar_step_ms']:.2f}x an AR step")
        versus = "-" if b is None or b is r else f"{b['ar_ms'] / r['ar_ms']:.2f}x"
        of_floor = "-" if floor is None else f"{r['ar_ms'] / floor:.2f}x"
        prof = r.get("profile") or {}
        kernels = (f"{prof['kernels_per_step']:.0f} / {prof['kernel_us_per_step']:.0f} / {prof['span_us_per_step']:.0f}"
                   if "kernels_per_step" in prof else "-")
        rows.append(f"| {r['setting']} | {r['about']} | {r['ar_ms']:.3f} | {r['ar_tokens_per_s']:.0f} | {versus} | "
                    f"{of_floor} | {kernels} | {same} | {projected} |")
    first = next((r for r in records if "error" not in r), {})
    return "\n".join([
        "# AR decoding and S3D's steps under issue 70's settings (random weights)", "",
        f"- device: {first.get('device', '-')} (jax {first.get('jax', '-')}); date {datetime.date.today().isoformat()}",
        f"- AR: bf16, one prompt of random tokens, greedy, the best of 3 timed decode calls after a warm one "
        f"(prefill excluded); floor: the weights' bytes over the measured copy bandwidth "
        f"({'-' if copy_bw is None else f'{copy_bw / 1e9:.0f} GB/s'})",
        f"- profiled: {PROFILE_STEPS} decode steps under JAX's profiler (its Perfetto trace): kernels a step, their summed "
        "time, and the device's span from the first kernel's start to the last one's end, a step",
        f"- same tokens: the share of the first lease's setting's greedy tokens this setting reproduces (bf16 rounds "
        f"products apart where the logits nearly tie)",
        f"- S3D projection: tau {t if t is None else f'{t:.2f}'} (the shipped draft, gamma 4, MT-Bench 80 on the CPU: "
        f"{os.path.relpath(ACCEPTANCE, ROOT)}) over draft + verify step, against one AR step, both timed here; a "
        "projection, not a measured run", "",
        "| setting | what | AR ms/token | AR tokens/s | vs first lease's setting | vs HBM floor | kernels / kernel µs / "
        "device span µs a step (profiled) | same tokens | S3D (projected) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "", *top_kernels(records)])


def top_kernels(records: list[dict]) -> list[str]:
    """Each profiled setting's costliest kernels a step (µs), names without their instance numbers."""
    out = []
    for r in records:
        top = (r.get("profile") or {}).get("top_us_per_step")
        if top:
            out += [f"- {r['setting']}, the costliest kernels a step: "
                    + ", ".join(f"{name} {us:.0f} µs" for name, us in top.items())]
    return out


def main():
    p = Parser(prog="python -m benchmarks.gpu_steps", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--only", help="comma-separated settings: " + ", ".join(SETTINGS))
    p.add_argument("--quick", action="store_true", help="small shapes and few tokens: checks the script on a CPU")
    p.add_argument("--deadline-s", type=float, default=480.0, help="start no setting after this many seconds")
    p.add_argument("--setting", help=argparse.SUPPRESS)  # a child process's one setting
    p.add_argument("--table", metavar="JSONL", help="only write the table again from a run's gpu_steps.jsonl")
    args = p.parse_args()
    if args.table:
        return rewrite(args.table, args.out)
    context, new_tokens = (32, 8) if args.quick else (256, 128)
    if args.setting:  # a child: one setting, its record on stdout
        measure(args.setting, args.quick, context, new_tokens, lambda r: print(json.dumps(r), flush=True))
        return
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    os.makedirs(args.out, exist_ok=True)
    start, records = time.perf_counter(), []
    for name in names:
        left = args.deadline_s - (time.perf_counter() - start)
        if left < 30:
            print(f"{name}: skipped, {left:.0f} s left before the deadline", file=sys.stderr, flush=True)
            continue
        argv = [sys.executable, "-m", "benchmarks.gpu_steps", "--out", args.out, "--setting", name] + (["--quick"] if args.quick else [])
        print(f"{name}... ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        try:
            r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=min(max(left, 30), SETTING_LIMIT_S))
            out, failed = r.stdout, r.returncode and (r.stderr.strip().splitlines() or ["no output"])[-1]
            stderr = r.stderr
        except subprocess.TimeoutExpired as e:
            out, failed, stderr = e.stdout, "timed out", e.stderr
        out, stderr = (x.decode() if isinstance(x, bytes) else x or "" for x in (out, stderr))
        lines = [line for line in out.splitlines() if line.startswith("{")]
        record = json.loads(lines[-1]) if lines else {"setting": name, "model": SETTINGS[name].model, "error": failed}
        if failed and lines:
            record["cut_short"] = failed  # the record as far as it got
        if failed:
            record["stderr_tail"] = stderr[-2000:]
        records.append(record)
        print(f"{name}: " + (record.get("error") or f"{record['ar_ms']:.3f} ms a token"), file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "gpu_steps.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    from benchmarks import report

    copy_bw = None if args.quick else report.copy_bandwidth(20)
    with open(os.path.join(args.out, "gpu_steps.jsonl"), "a") as f:
        f.write(json.dumps({"copy_bw": copy_bw}) + "\n")
    report.write(args.out, "gpu_steps", table(records, copy_bw))


def rewrite(jsonl: str, out: str) -> None:
    """The table again from a run's records (`--table`), here with the acceptance file a GPU run may not carry."""
    with open(jsonl) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    copy_bw = next((r["copy_bw"] for r in lines if "copy_bw" in r), None)
    text = table([r for r in lines if "setting" in r], copy_bw)
    from benchmarks import report

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"gpu_steps-{report.kind_slug(lines[0].get('device', 'device'))}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    run(main)
