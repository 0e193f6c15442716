"""Why verifying M tokens costs more than one on the CPU: a chain of SmolLM2-sized matmuls at M rows
against M = 1, in several formulations. On a memory-bound device M = 5 should cost about as much
as M = 1 (the weights are read once either way); XLA's CPU backend runs M = 1 as its own GEMV and
M > 1 as a GEMM, and the ratio is what a speculative step pays per verified token.

    python -m benchmarks.research.small_m_matmul [--repeats 20]

Run it under different XLA_FLAGS (e.g. --xla_cpu_experimental_ynn_fusion_type=individual_dot) to
compare CPU dot backends; the flags go into the table. Where the CPU decode matmul (`cpu_kernels`) runs,
it is timed too, on packed fp32, bf16 and int8 weights (int8 against XLA's fused convert), with the
weights' read speed: bytes over time.
"""

from __future__ import annotations

import datetime
import os

from benchmarks import report
from s3djax.cli import run

K, N, LAYERS = 576, 1536, 30  # SmolLM2's hidden and MLP widths, one matmul per layer
ROWS = (1, 2, 3, 5, 9, 17, 32)


def main():
    args = report.timing_args("benchmarks.research.small_m_matmul", __doc__, repeats=20)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpu_kernels import matmul
    from s3djax import device, quant

    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((K, N), np.float32) * 0.02) for _ in range(LAYERS)]
    transposed = [w.T.copy() for w in weights]
    int8 = [quant.quantize(w, 1) for w in weights]
    forms = {  # name: (x, w) -> x @ w in some formulation, and the weights it takes
        "x @ w": (lambda x, w: x @ w, weights),
        "(w.T @ x.T).T": (lambda x, w: (w @ x.T).T, transposed),
        "vmap of GEMVs": (lambda x, w: jax.vmap(lambda v: v @ w)(x), weights),
        "one GEMV per row": (lambda x, w: jnp.stack([x[i] @ w for i in range(x.shape[0])]), weights),
        "XLA int8 (fused convert)": (quant.dot, int8),
    }
    if matmul.usable():
        def packed(ws, dtype):
            return [quant.pack_for_cpu({"up": w.astype(dtype) if dtype else w})["up"] for w in ws]

        forms.update({
            "kernel, packed fp32": (quant.dot, packed(weights, None)),
            "kernel, packed bf16": (lambda x, w: quant.dot(x.astype(jnp.bfloat16), w), packed(weights, jnp.bfloat16)),
            "kernel, packed int8": (quant.dot, packed(int8, None)),
            "kernel, plain [K, N] fp32": (lambda x, w: quant.dot(x, w, True), weights),
        })
    rows, nbytes = {}, {}
    for name, (form, ws) in forms.items():
        nbytes[name] = quant.param_bytes(ws)
        chain = jax.jit(lambda x, ws, form=form: sum(form(x, w).sum() for w in ws))
        rows[name] = {m: report.median_us(chain, jnp.ones((m, K), jnp.float32), ws, repeats=args.repeats) / 1e3
                      for m in ROWS}
    lines = [f"# {LAYERS} chained [M, {K}] x [{K}, {N}] fp32 matmuls: M rows against one", "",
             f"- device: {device.describe()}", f"- date: {datetime.date.today().isoformat()}",
             f"- XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`; median of {args.repeats}",
             f"- CPU kernel: {matmul.isa() or matmul.unavailable()}", "",
             "| formulation | weight MB | " + " | ".join(f"M = {m} ms" for m in ROWS)
             + " | M = 1 GB/s | M = 5 vs M = 1 | M = 17 vs M = 1 |", "| --- |" + " --- |" * (len(ROWS) + 4)]
    lines += [f"| {name} | {nbytes[name] / 1e6:.0f} | " + " | ".join(f"{ms[m]:.2f}" for m in ROWS)
              + f" | {nbytes[name] / ms[1] / 1e6:.1f} | {ms[5] / ms[1]:.2f}x | {ms[17] / ms[1]:.2f}x |"
              for name, ms in rows.items()]
    report.write(args.out, "small_m_matmul", "\n".join(lines))


if __name__ == "__main__":
    run(main)
