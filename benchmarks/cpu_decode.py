"""`ar` decode speed of every weight form on the CPU, against today's fp32 XLA path and llama.cpp, in one process.

    python -m benchmarks.cpu_decode [--limit 8] [--max-new-tokens 128] [--forms fp32-xla,fp32,bf16,int8,int8-all]

Each form is our greedy `ar` on SmolLM2: fp32 with XLA's dot for every product (`fp32-xla`, the path
before the CPU matmul kernel), then fp32, bf16, int8 and int8-all weights through the kernel. The
llama.cpp peers (F32, Q8_0, and the shipped Q4_1 GGUF) run beside them where llama-cpp-python is
installed. Every form decodes the same MT-Bench first turns, the order rotating per prompt; tokens/s
pools decode time (after the first token) over prompts. Writes a table named for the device.
"""

from __future__ import annotations

import dataclasses
import datetime

from benchmarks import report
from s3djax.cli import Parser, run

FORMS = {  # name: (dtype, quantization, CPU kernel), and what the weights are
    "fp32-xla": ("float32", None, False),
    "fp32": ("float32", None, True),
    "bf16": ("bfloat16", None, True),
    "int8": ("float32", "int8", True),
    "int8-all": ("float32", "int8-all", True),
    "w8a8": ("float32", "w8a8", True),
}
PEERS = ("llamacpp-f32", "llamacpp-q8_0", "llamacpp-gguf")


def main():
    p = Parser(prog="python -m benchmarks.cpu_decode", description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=8, help="MT-Bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--forms", default=",".join(FORMS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--peers", default=",".join(PEERS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    p.check(args, limit=args.limit >= 1, forms=set(args.forms) <= set(FORMS) and args.forms[:1] == ["fp32-xla"],
            peers=set(args.peers) <= set(PEERS))

    import numpy as np

    from cpu_kernels import matmul
    from infer import llamacpp
    from s3djax import bench_data, device, quant
    from s3djax.generator import Generator

    base = Generator("smollm2-135m", load=False)
    prompts = [x["ids"] for x in bench_data.prompts("mt-bench", base.tokenizer, args.limit)]
    runs, about, loaded = {}, {}, {}
    for name in args.forms:
        dtype, quantization, kernel = FORMS[name]
        key = (dtype, quantization)
        if key not in loaded:
            loaded[key] = Generator("smollm2-135m", dtype=dtype, quant=quantization, max_cache_len=2048).model
        m = loaded[key]
        gen = Generator.from_model(dataclasses.replace(m, config=m.config.replace(cpu_kernel=kernel)), dtype=dtype)
        session = gen.session("ar")
        runs[name] = lambda ids, n, r=session.runner: r.generate(ids, n)
        about[name] = f"{quant.param_bytes(session.built.params) / 2**20:.0f} MiB of weights"
    notes = []
    for name in args.peers:
        if why := llamacpp.fails(name, base.source.path):
            notes.append(f"{name} skipped: {why}")
            continue
        llm = llamacpp.model(name, base.source.path, n_ctx=2048)
        peer = llamacpp.peer(llm, loaded[("float32", None)].eos_ids if ("float32", None) in loaded else ())
        runs[name] = lambda ids, n, peer=peer: peer(ids, n)
        about[name] = llamacpp.gguf_for(name, base.source.path).rsplit("/", 1)[-1]
    for r in runs.values():  # compile and warm up
        r(prompts[0], 8)
    tokens, seconds = {n: 0 for n in runs}, {n: 0.0 for n in runs}
    outputs = {n: [] for n in runs}
    names = list(runs)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = runs[name](ids, args.max_new_tokens)
            toks, decode_s = (r["tokens"], r["decode_s"]) if isinstance(r, dict) else (r.tokens, r.decode_s)
            tokens[name] += max(len(toks) - 1, 0)
            seconds[name] += decode_s
            outputs[name].append(toks)
    tps = {n: tokens[n] / seconds[n] for n in runs}
    base_tps = tps["fp32-xla"]
    fp32 = outputs.get("fp32")
    lines = [f"# ar decode on the CPU: weight forms through the CPU matmul kernel, XLA's fp32 path and llama.cpp", "",
             f"- device: {device.describe()}; CPU kernel: {matmul.isa() or matmul.unavailable()}",
             f"- date: {datetime.date.today().isoformat()}; SmolLM2-135M-Instruct, greedy, {len(prompts)} MT-Bench "
             f"first turns, {args.max_new_tokens} new tokens at most, cache 2048, one process, order rotating per prompt",
             *[f"- note: {n}" for n in notes], "",
             "| form | weights | tokens/s | vs fp32-xla | outputs equal to fp32's |", "| --- | --- | --- | --- | --- |"]
    for name in runs:
        same = "-" if fp32 is None else f"{np.mean([a == b for a, b in zip(outputs[name], fp32)]):.0%}"
        lines.append(f"| {name} | {about[name]} | {tps[name]:.1f} | {tps[name] / base_tps:.2f}x | {same} |")
    report.write(args.out, f"cpu_decode-{datetime.date.today().isoformat()}", "\n".join(lines))


if __name__ == "__main__":
    run(main)
