"""The core promise under the compile users run: the suite runs with JAX_DISABLE_MOST_OPTIMIZATIONS=1 (conftest), so
here greedy s3d, kangaroo and lookup are checked against greedy ar in a process compiled with every optimization."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = """
import json, s3djax
gen = s3djax.Generator("smollm2-135m", max_cache_len=256, progress=False)
prompts = ["Write a haiku about the sea.", "def fibonacci(n):"]
print(json.dumps({m: [gen.generate(p, max_new_tokens=40, method=m).token_ids for p in prompts]
                  for m in ("ar", "s3d", "kangaroo", "lookup")}))
"""


def test_greedy_speculative_output_equals_ar_under_the_optimized_compile():
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(10 <= len(t) <= 40 for t in tokens["ar"]), [len(t) for t in tokens["ar"]]
    for method in ("s3d", "kangaroo", "lookup"):
        assert tokens[method] == tokens["ar"], method
