"""The core promise under the compile users run: the suite runs with JAX_DISABLE_MOST_OPTIMIZATIONS=1 (conftest), so
here greedy s3d, kangaroo and lookup are checked against greedy ar in a process compiled with every optimization, and
kangaroo in bfloat16 on MT-Bench's third question, where its verify (resuming from the exit states its drafts stored)
left `ar` at the 8th token while XLA could keep fused bfloat16 values in fp32 (`compile_options.exact_rounding`)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = """
import json, s3djax, s3djax.bench_data
gen = s3djax.Generator("smollm2-135m", max_cache_len=256, progress=False)
prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
out = {m: [gen.generate(p, max_new_tokens=40, method=m).token_ids for p in prompts]
       for m in ("ar", "s3d", "kangaroo", "lookup")}
bf16 = s3djax.Generator("smollm2-135m", dtype="bfloat16", max_cache_len=512, progress=False)
question = s3djax.bench_data.prompts("mt-bench", bf16.tokenizer, 3)[2]["text"]
out["bf16"] = {m: bf16.generate(question, max_new_tokens=24, method=m).token_ids for m in ("ar", "kangaroo")}
print(json.dumps(out))
"""


def test_greedy_speculative_output_equals_ar_under_the_optimized_compile():
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(10 <= len(t) <= 40 for t in tokens["ar"]), [len(t) for t in tokens["ar"]]
    for method in ("s3d", "kangaroo", "lookup"):
        assert tokens[method] == tokens["ar"], method
    assert len(tokens["bf16"]["ar"]) == 24 and tokens["bf16"]["kangaroo"] == tokens["bf16"]["ar"]
