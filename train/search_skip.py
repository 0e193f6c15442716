"""Search Self-Spec's skip plan by Bayesian optimisation (Draft & Verify, Zhang et al. 2024, section 3.3).

The 2L variables say, per layer, whether the draft skips its attention and its MLP; the objective is
the paper's: decode seconds per generated token on a small development set (greedy, held-out ShareGPT
first turns, never the benchmark's MT-Bench). Every candidate runs in ONE compiled speculative decoder:
the plan is a traced mask (`DynamicPlan`, each sub-layer under `lax.cond`) read from the draft params,
so a trial swaps two bool arrays and recompiles nothing. The winner is frozen into a static `SkipPlan`,
re-timed as it will be deployed (skipped sub-layers compiled out) beside `ar` in the same process,
and written as a YAML plan for `infer.generate --method self-spec --skip-plan`.

The study is an optuna journal in the run folder: an interrupted search resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import statistics
import time
import warnings

import jax
import numpy as np

from s3djax.cli import Parser, output_folder, run
from s3djax import bench_data, device
from s3djax.decode import ARDecoder, Runner
from s3djax.errors import UserError
from s3djax.loading import LoadedModel
from s3djax.skip_plan import SkipPlan
from s3djax.speculative import tree as trees
from s3djax.speculative.drafters.self_spec import AdaptiveThreshold, SelfSpecDrafter, save_plan
from s3djax.speculative.loop import SpecDecoder

STUDY = "self-spec-skip"
PARTS = ("attn", "mlp")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    trials: int = 60
    max_new_tokens: int = 32
    max_draft: int = 12         # the paper's K, and infer.generate's self-spec default for a plan that records none
    seed: int = 0
    max_cache_len: int = 0      # 0: just enough for the development set
    # A candidate is cut short (its estimate so far kept, flagged partial) once, after at least two
    # prompts, it is `cutoff` times slower than the best so far: hopeless plans cost little.
    cutoff: float = 2.0
    finalists: int = 3          # the best trials re-timed `repeats` times beside ar; the median decides
    repeats: int = 3
    seeds: bool = True          # enqueue a few hand-made plans first, so the sampler starts from drafts
    threshold: AdaptiveThreshold = AdaptiveThreshold()  # the draft-exiting rule, the paper's by default


def plan_of(params: dict, num_layers: int) -> SkipPlan:
    """Optuna's {"attn_3": "skip", ...} as a plan; SkipPlan refuses one that skips everything."""
    keep = {part: tuple(params[f"{part}_{i}"] == "keep" for i in range(num_layers)) for part in PARTS}
    return SkipPlan(keep["attn"], keep["mlp"])


def params_of(plan: SkipPlan) -> dict:
    return {f"{part}_{i}": "keep" if run_ else "skip"
            for part in PARTS for i, run_ in enumerate(getattr(plan, part))}


def seed_plans(num_layers: int) -> list[SkipPlan]:
    """Starting points: every other attention in the middle half (the paper finds attention the more
    skippable sub-layer), the whole middle half's attention, and S3D's symmetric middle layers."""
    lo, hi = num_layers // 4, num_layers - num_layers // 4
    every_other = ",".join(f"{i}.attn" for i in range(lo, hi, 2))
    plans = [SkipPlan.parse(every_other, num_layers), SkipPlan.parse(f"{lo}-{hi - 1}.attn", num_layers),
             SkipPlan.symmetric_middle(num_layers, num_layers // 2 - 1)]
    return list({p.spec(): p for p in plans if not p.is_full}.values())


def flags(plan: SkipPlan) -> dict:
    """The traced plan the search decoder reads from its draft params."""
    return {"attn": np.asarray(plan.attn, bool), "mlp": np.asarray(plan.mlp, bool)}


class Evaluator:
    """Times candidates on the development set: one traced-plan decoder for all of them, `ar` beside it."""

    def __init__(self, m: LoadedModel, prompts: list[list[int]], cfg: SearchConfig):
        if not prompts or not all(prompts):
            raise UserError("the development set is empty, or holds an empty prompt")
        self.m, self.prompts, self.cfg = m, prompts, cfg
        cache = cfg.max_cache_len or max(len(p) for p in prompts) + cfg.max_new_tokens + 1
        pad = getattr(m.tokenizer, "pad_token_id", None) or 0
        self.ar_decoder = ARDecoder(m.config, cache, eos_ids=m.eos_ids, pad_id=pad)
        self.tree = trees.resolve("chain", cfg.max_draft)
        self.ar = Runner(self.ar_decoder, m.params)
        traced = SelfSpecDrafter(m.config, None, self.tree, cfg.threshold)  # the plan comes with the params
        full = flags(SkipPlan.full(m.config.num_layers))
        self.spec = Runner(SpecDecoder.create(self.ar_decoder, traced), (m.params, full))
        self._static: dict = {}

    def static_runner(self, plan: SkipPlan) -> Runner:
        """The deployed form: the plan is static, so its skipped sub-layers are compiled out."""
        if plan not in self._static:
            drafter = SelfSpecDrafter(self.m.config, plan, self.tree, self.cfg.threshold)
            self._static[plan] = Runner(SpecDecoder.create(self.ar_decoder, drafter), (self.m.params, {}))
        return self._static[plan]

    def warm_up(self, runner: Runner | None = None) -> float:
        """Compile (one prefill per prompt bucket, one loop) outside every timing."""
        t = time.perf_counter()
        for r in [runner] if runner else [self.ar, self.spec]:
            for p in self.prompts:
                r.generate(p, 2)
        return time.perf_counter() - t

    def measure(self, runner: Runner, plan: SkipPlan | None = None, give_up_at: float = math.inf) -> dict:
        """Decode ms per generated token over the dev prompts (tokens after the first, as decode_s
        times them). With `plan`, the traced decoder runs that plan. Stops early (partial) once,
        after two prompts or more, the running figure exceeds `give_up_at` ms/token."""
        if plan is not None:
            runner.params = (self.m.params, flags(plan.check(self.m.config.num_layers)))
        seconds, tokens, accepted, drafted, outputs = 0.0, 0, [], [], []
        for i, p in enumerate(self.prompts):
            r = runner.generate(p, self.cfg.max_new_tokens)
            seconds += r.decode_s
            tokens += len(r.tokens) - 1
            outputs.append(r.tokens)
            if r.stats:
                accepted += r.stats["accepted_per_step"]
                drafted.append(r.stats["mean_drafted"])
            if i >= 1 and i + 1 < len(self.prompts) and 1000 * seconds / max(tokens, 1) > give_up_at:
                break
        out = {"ms_per_token": 1000 * seconds / max(tokens, 1), "tokens": tokens, "prompts": len(outputs),
               "partial": len(outputs) < len(self.prompts), "outputs": outputs}
        if accepted:
            out.update(tau=float(np.mean(np.asarray(accepted) + 1)), mean_drafted=float(np.mean(drafted)))
        return out


def journal(out: str):
    import optuna
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna.storages.JournalStorage(JournalFileBackend(os.path.join(out, "study.journal")))


def open_study(storage, seed: int, finished: int):
    import optuna

    # A resumed run reseeds past the trials done, so TPE's random start does not replay them.
    sampler = optuna.samplers.TPESampler(seed=seed + finished, multivariate=True, n_startup_trials=10)
    return optuna.create_study(study_name=STUDY, storage=storage, sampler=sampler, direction="minimize",
                               load_if_exists=True)


def finished_trials(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def search(m: LoadedModel, prompts: list[list[int]], out: str, cfg: SearchConfig = SearchConfig(),
           progress: bool | None = None, dev_set: dict | None = None, plan_out: str | None = None,
           evaluator: Evaluator | None = None) -> dict:
    """Run (or resume) the study in `out` up to `cfg.trials` finished trials, freeze the best plan and
    write it to `plan_out` (default OUT/plan.yaml). Returns {"plan", "path", "meta", "ran"}.

    `evaluator`: one built for these prompts and settings before (its executables are reused)."""
    import optuna
    from optuna.trial import TrialState
    from s3djax import progress as progress_bar

    os.makedirs(out, exist_ok=True)
    num_layers = m.config.num_layers
    storage = journal(out)
    done = len(finished_trials(open_study(storage, cfg.seed, 0)))
    study = open_study(storage, cfg.seed, done)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # a process killed mid-trial
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        if len(t.params) == 2 * num_layers:  # its plan was drawn: time it again
            study.enqueue_trial(t.params)
    if not study.get_trials(deepcopy=False) and cfg.seeds:
        for plan in seed_plans(num_layers):
            study.enqueue_trial(params_of(plan))

    ev = evaluator or Evaluator(m, prompts, cfg)
    compile_s = ev.warm_up()
    log_path = os.path.join(out, "trials.jsonl")
    bar = progress_bar.bar(total=cfg.trials, initial=min(done, cfg.trials), desc="search", unit="trial",
                           show=progress, dynamic_ncols=True)

    def best():
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return min(complete, key=lambda t: t.value) if complete else None

    def objective(trial):
        names = [f"{part}_{i}" for part in PARTS for i in range(num_layers)]
        params = {n: trial.suggest_categorical(n, ["keep", "skip"]) for n in names}
        try:
            plan = plan_of(params, num_layers)
        except UserError:  # skips every sub-layer: nothing would run
            raise optuna.TrialPruned("the plan skips every sub-layer")
        b = best()
        t = time.perf_counter()
        r = ev.measure(ev.spec, plan, give_up_at=cfg.cutoff * b.value if b else math.inf)
        record = {"trial": trial.number, "skip": plan.spec(), "attn_skipped": num_layers - sum(plan.attn),
                  "mlp_skipped": num_layers - sum(plan.mlp), **{k: v for k, v in r.items() if k != "outputs"},
                  "seconds": round(time.perf_counter() - t, 2)}
        for k, v in record.items():
            trial.set_user_attr(k, v)
        return r["ms_per_token"]

    def log(study, trial):
        record = {"trial": trial.number, "state": trial.state.name, **trial.user_attrs}
        if trial.state == TrialState.PRUNED:
            record["skip"] = "(everything)"
        b = best()
        record["best_ms_per_token"] = b.value if b else None
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        bar.update(1)
        if b:
            bar.set_postfix_str(f"best {b.value:.1f} ms/tok (tau {b.user_attrs.get('tau', 0):.2f}) "
                                f"skip {b.user_attrs['skip']}")

    left = max(cfg.trials - done, 0)
    if left:
        study.optimize(objective, n_trials=left, callbacks=[log], catch=())
    bar.close()
    return finish(study, ev, cfg, out, plan_out or os.path.join(out, "plan.yaml"), dev_set or {}, left, compile_s)


def finish(study, ev: Evaluator, cfg: SearchConfig, out: str, plan_out: str, dev_set: dict, ran: int,
           compile_s: float) -> dict:
    """Re-time the finalists beside ar (median of repeats, interleaved so load drifts hit both alike),
    freeze the winner, time its static decoder, and write the plan."""
    from optuna.trial import TrialState

    num_layers = ev.m.config.num_layers
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value)
    full = [t for t in complete if not t.user_attrs.get("partial")] or complete
    if not full:
        raise UserError(f"the study in {out} has no completed trial to choose a plan from")
    finalists, seen = [], set()
    for t in full:
        plan = plan_of(t.params, num_layers)
        if plan.spec() not in seen:
            seen.add(plan.spec())
            finalists.append((t, plan))
        if len(finalists) == cfg.finalists:
            break
    times = {"ar": []} | {plan.spec(): [] for _, plan in finalists}
    stats = {}
    for _ in range(cfg.repeats):
        times["ar"].append(ev.measure(ev.ar)["ms_per_token"])
        for t, plan in finalists:
            r = ev.measure(ev.spec, plan)
            times[plan.spec()].append(r["ms_per_token"])
            stats[plan.spec()] = r
    ar_ms = statistics.median(times["ar"])
    trial, plan = min(finalists, key=lambda tp: statistics.median(times[tp[1].spec()]))
    static = ev.static_runner(plan)
    ev.warm_up(static)
    static_runs = [ev.measure(static) for _ in range(cfg.repeats)]
    static_ms = statistics.median(r["ms_per_token"] for r in static_runs)
    if static_runs[0]["outputs"] != stats[plan.spec()]["outputs"]:
        raise RuntimeError("the frozen plan decodes differently from its traced form: a bug in the search decoder")
    meta = {
        "method": "self-spec",
        "found_by": f"python -m train.search_skip: optuna TPE (multivariate, seed {cfg.seed}), "
                    f"{'hand-made seed plans first, ' if cfg.seeds else ''}{cfg.finalists} finalists re-timed",
        "objective": "decode ms per generated token, greedy, on the development set",
        "ms_per_token": round(static_ms, 2),
        "ar_ms_per_token": round(ar_ms, 2),
        "speedup_vs_ar": round(ar_ms / static_ms, 3),
        "traced_ms_per_token": round(statistics.median(times[plan.spec()]), 2),  # the search decoder's re-timing
        "trial_ms_per_token": round(trial.value, 2),  # its one timing during the search
        "tau": round(stats[plan.spec()]["tau"], 3),
        "mean_drafted": round(stats[plan.spec()]["mean_drafted"], 3),
        "attn_skipped": num_layers - sum(plan.attn),
        "mlp_skipped": num_layers - sum(plan.mlp),
        "trials": len(finished_trials(study)),
        "best_trial": trial.number,
        "finalists": {spec: [round(x, 2) for x in ts] for spec, ts in times.items()},
        "max_draft": cfg.max_draft,
        "dev_set": {**dev_set, "prompts": len(ev.prompts), "max_new_tokens": cfg.max_new_tokens,
                    "max_cache_len": ev.ar_decoder.max_cache_len},
        "timing": f"median of {cfg.repeats} runs over the development set, ar and the finalists interleaved; "
                  f"ms_per_token is the frozen (static) plan's",
        "compile_s": round(compile_s, 1),
        "device": device.describe(),
        "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
    }
    save_plan(plan_out, plan, meta)
    return {"plan": plan, "path": plan_out, "meta": meta, "ran": ran}


def main(argv=None):
    p = Parser(prog="python -m train.search_skip", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a registry name, a .gguf file or a checkpoint folder")
    p.add_argument("--checkpoint", help="the checkpoint folder of a registry shape without a shipped file")
    p.add_argument("--out", required=True, help="the run folder: study journal, trials.jsonl, plan.yaml")
    p.add_argument("--trials", type=int, default=SearchConfig.trials, help="finished trials in all (a resumed "
                   "search runs the rest)")
    p.add_argument("--dataset", default="sharegpt-heldout", help="development prompts: " + ", ".join(bench_data.DATASETS))
    p.add_argument("--prompts", type=int, default=8, help="development prompts (the paper uses 8)")
    p.add_argument("--max-new-tokens", type=int, default=SearchConfig.max_new_tokens)
    # Not `max_draft`: Parser.check would then expect the speculative methods' other flags.
    p.add_argument("--max-draft", dest="depth", type=int, default=SearchConfig.max_draft,
                   help="the deepest draft (infer.generate's self-spec default is 12)")
    p.add_argument("--max-cache-len", type=int, default=0, help="0: just enough for the development set")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--cutoff", type=float, default=SearchConfig.cutoff,
                   help="stop timing a candidate once it is this many times slower than the best so far")
    p.add_argument("--finalists", type=int, default=SearchConfig.finalists)
    p.add_argument("--repeats", type=int, default=SearchConfig.repeats)
    p.add_argument("--no-seed-plans", dest="seed_plans", action="store_false",
                   help="start from random plans, not the hand-made ones")
    p.add_argument("--plan-out", help="where to write the plan (default OUT/plan.yaml)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.depth < 1:
        p.error(f"argument --max-draft: invalid value {args.depth}")
    p.check(args, trials=args.trials >= 1, prompts=args.prompts >= 1, max_new_tokens=args.max_new_tokens >= 2,
            max_cache_len=args.max_cache_len >= 0, cutoff=args.cutoff > 1, finalists=args.finalists >= 1,
            repeats=args.repeats >= 1, dataset=args.dataset in bench_data.DATASETS)
    from s3djax.loading import open_model

    cfg = SearchConfig(trials=args.trials, max_new_tokens=args.max_new_tokens, max_draft=args.depth, seed=args.seed,
                       max_cache_len=args.max_cache_len, cutoff=args.cutoff, finalists=args.finalists,
                       repeats=args.repeats, seeds=args.seed_plans)
    source = open_model(args.model, args.checkpoint)
    dev = bench_data.prompts(args.dataset, source.tokenizer, args.prompts)
    if len(dev) < args.prompts:
        raise UserError(f"{args.dataset} has only {len(dev)} prompts; lower --prompts")
    output_folder(args.out)
    m = source.load(progress=False if args.quiet else None)
    result = search(m, [d["ids"] for d in dev], args.out, cfg, progress=False if args.quiet else None, plan_out=args.plan_out,
                    dev_set={"dataset": args.dataset, "ids": [d["id"] for d in dev]})
    meta = result["meta"]
    print(f"{result['ran']} trials run now, {meta['trials']} in all; best plan: skip {result['plan'].spec()}")
    print(f"  {meta['ms_per_token']} ms/token vs ar {meta['ar_ms_per_token']} ms/token "
          f"({meta['speedup_vs_ar']:.2f}x), tau {meta['tau']}, {meta['device']}")
    if meta["speedup_vs_ar"] < 1:
        print("  note: on this device the best plan found is slower than plain autoregressive decoding")
    print(f"plan -> {result['path']} (python -m infer.generate --method self-spec --skip-plan {result['path']})")


if __name__ == "__main__":
    logging.getLogger("jax").setLevel(logging.ERROR)
    run(main)
