# One process: decode a few prompts with each method, report tok/s (fastest of rounds) and NPROC.
import os, sys, time, json
sys.path.insert(0, "/work/main")
os.environ.setdefault("S3DJAX_CACHE", os.path.expanduser("~/.cache/s3djax"))
import s3djax
from s3djax import Sampling
dtype = sys.argv[1]; methods = sys.argv[2].split(","); sampled = len(sys.argv) > 3 and sys.argv[3] == "sampled"
gen = s3djax.Generator("smollm2-135m", dtype=dtype)
prompts = ["Explain why the sky is blue.", "Write a Python function that checks whether a number is prime.",
           "Give three tips for staying healthy."]
samp = Sampling(temperature=0.7, top_p=0.9) if sampled else s3djax.sampling.GREEDY if hasattr(s3djax, 'sampling') else None
out = {}
for m in methods:
    kw = dict(method=m)
    if sampled: kw["sampling"] = Sampling(temperature=0.7, top_p=0.9); kw["seed"] = 1
    gen.generate(prompts[0], 16, **kw)
    best = 0
    for r in range(2):
        toks = secs = 0
        for p in prompts:
            o = gen.generate(p, 128, **kw)
            toks += len(o.token_ids) - 1; secs += (len(o.token_ids) - 1) / o.tokens_per_s
        best = max(best, toks / secs)
    out[m] = round(best, 1)
print(json.dumps({"NPROC": os.environ.get("NPROC", "-"), "dtype": dtype, "sampled": sampled, **out}), flush=True)
