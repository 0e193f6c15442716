# Whether a batch drafts (`defaults.batch_choice`) for every method at 2, 4 and 8 rows greedy, 2 and 4 sampled at
# 0.7 / top-p 0.9, each measured then: `python batch-choices.py` from the project's root, nothing else running.
from s3djax import defaults
from s3djax.generator import Generator
from s3djax.sampling import GREEDY, Sampling

gen = Generator("smollm2-135m")
for samp, label in ((GREEDY, "greedy"), (Sampling(0.7, top_p=0.9), "0.7 / top-p 0.9")):
    ar = gen.session("ar", sampling=samp, defaults=False).runner
    for method in ("s3d", "kangaroo", "self-spec", "s2d", "lookup"):
        spec = gen.session(method, sampling=samp)
        for rows in ((2, 4, 8) if label == "greedy" else (2, 4)):
            drafts, how = defaults.batch_choice(method, spec.built.chosen, spec.runner, ar, rows, gen._timing_text)
            print(f"| {label} | {method} | {rows} | {how} |", flush=True)
