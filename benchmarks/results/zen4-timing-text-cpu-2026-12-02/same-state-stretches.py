import os, sys, time
sys.path.insert(0, "/work/main")
from s3djax import defaults, methods
from s3djax.decode import Runner
from s3djax.loading import load_model
from s3djax.speculative import gate
m = load_model("smollm2-135m", progress=False)
p = gate.prompt_ids(m.tokenizer); print("prompt", len(p))
b = methods.build("s3d", m, max_cache_len=2048, gamma=2)
ar = Runner(b.decoder.ar, b.params[0]); sp = Runner(b.decoder, b.params)
st = sp.prefill(p); st = st if b.decoder.drafter.force is None else {**st, "drafter": b.decoder.drafter.force(st["drafter"], False)}
ta, ts = defaults.loop_timer(ar, p), defaults.loop_timer(sp, p, st, "iteration")
for i in range(14):
    print(round(ta()*1e3, 2), round(ts()*1e3, 2), flush=True)
