import os, sys, time
sys.path.insert(0, "/work/main")
import jax, jax.numpy as jnp
from s3djax import defaults, methods
from s3djax.decode import Runner
from s3djax.loading import load_model
from s3djax.speculative import gate
m = load_model("smollm2-135m", progress=False)
p = gate.prompt_ids(m.tokenizer)
b = methods.build("ar", m, max_cache_len=2048)
ar = Runner(b.decoder, b.params)
same = defaults.loop_timer(ar, p)
state = [ar.prefill(p)]
decode = ar._compiled("decode", ar.decoder.decode, state[0], jnp.int32(0))[0]
def cont(n=48):
    if int(state[0]["step"]) > 1500: state[0] = ar.prefill(p)
    state[0], steps, s = gate.stretch(decode, ar.params, {**state[0], "done": jnp.zeros_like(state[0]["done"])}, n)
    return s / steps
cont(4)
for i in range(12):
    print(round(same()*1e3, 1), round(cont()*1e3, 1), flush=True)
