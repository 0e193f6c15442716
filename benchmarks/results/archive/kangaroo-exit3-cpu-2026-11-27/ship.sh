#!/usr/bin/env bash
# How configs/drafts/smollm2-135m-kangaroo-exit3.npz was made from the best held-out state of
# configs/train/kangaroo-smollm2-exit3-cpu.yaml: its 8,192-token draft vocabulary, then the settings measured
# fastest for exit 3 on the CPU. Run from the repository root.
set -euo pipefail
RUN=${1:-runs/kangaroo-smollm2-exit3-cpu}
OUT=${2:-configs/drafts/smollm2-135m-kangaroo-exit3.npz}
.venv/bin/python -m train.draft_vocab --data train/distilled/smollm2-sharegpt-10k --size 8192 --draft $RUN/draft.npz --out $OUT
.venv/bin/python - "$OUT" <<'PY'
import sys
import jax.numpy as jnp
from s3djax.speculative.draft_params import load_artifact, save_artifact
path = sys.argv[1]
tree, meta = load_artifact(path, jnp.float32)
lease = "benchmarks/results/gpu-lease3-nvidia-h100-80gb-hbm3-jax0.11.2-2026-11-26/cpu-kangaroo-exits.md"
save_artifact(path, tree, {**meta, "eta": 0.0, "tree": "chain", "max_draft": 2,
    "eta_sweep": "benchmarks/results/kangaroo-eta-cpu-2026-11-24.md", "max_draft_sweep": lease, "tree_sweep":
    "benchmarks/results/lookup-drafters-cpu-2026-11-26/kangaroo_lookup-cpu.md",
    "defaults_from": "eta 0 as measured for the exit-2 adapter; the chain and max draft 2 measured for the exit-3 "
                     "adapter with prompt lookup (the CPU's default switch 1), max draft 2 ahead of 3",
    "history": "exit 2: three CPU stages and configs/train/kangaroo-smollm2-gpu-10k.yaml (2,600 steps, H100); "
               "exit 3: configs/train/kangaroo-smollm2-gpu-deeper.yaml exit_layer=3 (3,000 steps, H100, held-out "
               "top-1 0.542), then configs/train/kangaroo-smollm2-exit3-cpu.yaml (cross-entropy on the "
               "self-distilled tokens, 2-core Zen 3)"})
print(path, {k: meta[k] for k in ("exit_layer", "steps", "held_out_acc", "cpu_hours", "vocab_coverage")})
PY
