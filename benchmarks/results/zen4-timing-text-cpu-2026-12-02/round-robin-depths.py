# Every s3d depth's loop and ar's, round robin, ROUNDS rounds; per-round ms a step (the landed measure_costs' timers).
import os, sys, json
sys.path.insert(0, "/work/main")
os.environ["S3DJAX_DEFAULTS"] = "fixed"
from s3djax import defaults, methods
from s3djax.decode import Runner
from s3djax.loading import load_model
m = load_model("smollm2-135m", progress=False)
prompt = [(7 * i) % 1000 + 100 for i in range(defaults.CONTEXT)]
depths = [1, 2, 3, 4]
timers = {}
for g in depths:
    b = methods.build("s3d", m, max_cache_len=defaults.CACHE_LEN, gamma=g)
    if "ar" not in timers:
        timers["ar"] = defaults.loop_timer(Runner(b.decoder.ar, b.params[0]), prompt)
    r = Runner(b.decoder, b.params); st = r.prefill(prompt)
    d = b.decoder.drafter
    st = st if d.force is None else {**st, "drafter": d.force(st["drafter"], False)}
    timers[g] = defaults.loop_timer(r, prompt, st, "iteration")
rounds = []
for i in range(int(sys.argv[1])):
    rounds.append({str(k): round(t() * 1e3, 2) for k, t in timers.items()})
    print(json.dumps(rounds[-1]), flush=True)
