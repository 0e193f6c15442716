"""The training loop every drafter's training shares: Optax AdamW with accumulation, Orbax checkpoints
that resume (same step, same data position, optimizer state restored), held-out evaluation,
metrics.jsonl and loss.png, FSDP/data sharding, and the export of the trained artifact.

What is trained, and on what loss, is a task (S3D's draft, Kangaroo's adapter, S2D's nested draft): a
frozen dataclass, so it is a static argument of the jitted steps, with
- `name`;
- `init_trainable(m, cfg, key)`: the trained parameters only (the rest stays frozen, so gradients reach
  only them by construction);
- `loss(trainable, frozen_params, batch, key) -> (loss, sums)`: sums hold per-head totals
  "depth_loss", "depth_correct", "depth_count" [H] (heads: S3D's depths, S2D's exits, Kangaroo's one),
  so gradient accumulation and devices add up exactly;
- `export(out, trained, meta) -> path`: write the artifact.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from s3djax.errors import UserError
from train import sharding
from train.config import RESUMABLE_CHANGES, TrainConfig
from train.shards import Shards


def optimizer(cfg: TrainConfig):
    """AdamW with linear warm-up then the schedule, global-norm clipping, and accumulation over micro-steps."""
    decay = max(cfg.steps - cfg.warmup_steps, 1)
    after = {"cosine": optax.cosine_decay_schedule(cfg.lr, decay),
             "linear": optax.linear_schedule(cfg.lr, 0.0, decay),
             "constant": optax.constant_schedule(cfg.lr)}[cfg.schedule]
    lr = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), after], [cfg.warmup_steps])
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), optax.adamw(lr, weight_decay=cfg.weight_decay))
    return optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum), lr


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Static settings of the jitted steps (gemma's pattern: `self` is a static argument)."""
    cfg: TrainConfig
    task: object

    @property
    def dtype(self):
        return jnp.bfloat16 if self.cfg.compute_dtype == "bfloat16" else jnp.float32

    def loss(self, trainable, frozen, batch, key):
        return self.task.loss(jax.tree.map(lambda x: x.astype(self.dtype), trainable), frozen, batch, key)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def train_step(self, state, frozen, batch):
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), state["micro_step"])
        (loss, sums), grads = jax.value_and_grad(self.loss, has_aux=True)(state["trainable"], frozen, batch, key)
        updates, opt_state = optimizer(self.cfg)[0].update(grads, state["opt_state"], state["trainable"])
        new = {"trainable": optax.apply_updates(state["trainable"], updates), "opt_state": opt_state,
               "micro_step": state["micro_step"] + 1}
        return new, loss, sums

    @functools.partial(jax.jit, static_argnums=0)
    def eval_step(self, trainable, frozen, batch, index):
        key = jax.random.fold_in(jax.random.key(self.cfg.seed + 1), index)  # fixed anchors: comparable evals
        if self.cfg.eval_answer_tokens:
            # Long greedy answers end in loops that are easy to predict, which a whole answer's agreement
            # counts and a 128-token benchmark never reaches.
            batch = dict(batch, loss_mask=first_answer_tokens(batch["loss_mask"], self.cfg.eval_answer_tokens))
        return self.loss(trainable, frozen, batch, key)[1]


def first_answer_tokens(loss_mask, n: int):
    """loss_mask [B, T] kept on the first n tokens of each answer, a run of trained tokens. A packed row may
    hold several, and a run that begins the row may go on from the row before it, so it is left out."""
    t = loss_mask.shape[1]
    pos = jnp.arange(t)[None]
    last_untrained = jax.lax.cummax(jnp.where(loss_mask > 0, -t - n, pos), axis=1)
    return loss_mask * (pos - last_untrained <= n).astype(loss_mask.dtype)


def summarize(sums: dict) -> dict:
    count = np.maximum(sums["depth_count"], 1.0)
    out = {"loss": float(np.sum(sums["depth_loss"]) / max(float(np.sum(sums["depth_count"])), 1.0)),
           "depth_loss": [round(float(x), 4) for x in sums["depth_loss"] / count],
           "depth_acc": [round(float(x), 4) for x in sums["depth_correct"] / count]}
    if "lm_loss" in sums:
        out["lm_loss"] = float(sums["lm_loss"] / max(float(sums["lm_count"]), 1.0))
    return out


def acceptance(record: dict) -> float:
    """A held-out record's agreement summed over heads: the yardstick `patience` stops on."""
    return float(sum(record["depth_acc"]))


def plateaued(evals: list[dict], patience: int) -> bool:
    """True once the last `patience` evaluations have all failed to beat the best one before them."""
    if not patience or len(evals) <= patience:
        return False
    return max(map(acceptance, evals[-patience:])) <= max(map(acceptance, evals[:-patience]))


class Metrics:
    """metrics.jsonl; on resume, records past the restored step are dropped so the log stays one run.
    Only the first process of a multi-host job writes files."""

    def __init__(self, path: str, resume_step: int):
        self.path, self.records, self.writer = path, [], jax.process_index() == 0
        if os.path.exists(path):
            with open(path) as f:
                self.records = [r for r in map(json.loads, filter(str.strip, f)) if r["step"] <= resume_step]
        if self.writer:
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.writer:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def check_resumable(cfg: TrainConfig, out: str) -> None:
    path = os.path.join(out, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            before = json.load(f)
        # A setting added since that run was saved had its default then.
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        changed = sorted(k for k, v in cfg.to_dict().items() if k not in RESUMABLE_CHANGES and before.get(k, defaults[k]) != v)
        if changed:
            raise UserError(f"{out} holds a run with different settings ({', '.join(changed)}); "
                            "rerun with the same config to resume, or choose another out")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)


def plot(records: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for split, style in (("train", "-"), ("eval", "o-")):
        rs = [r for r in records if r["split"] == split]
        if rs:
            ax[0].plot([r["step"] for r in rs], [r["loss"] for r in rs], style, label=split)
            for d in range(len(rs[0]["depth_acc"])) if split == "eval" else ():
                ax[1].plot([r["step"] for r in rs], [r["depth_acc"][d] for r in rs], style, label=f"depth {d + 1}")
    ax[0].set(xlabel="step", ylabel="block loss", title="loss")
    ax[1].set(xlabel="step", ylabel="top-1 = full model's greedy", title="held-out draft accuracy")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def train(cfg: TrainConfig, make_task, loaded=None, progress: bool | None = None, devices=None, on_step=None) -> dict:
    """Run (or resume) training to cfg.steps and export the artifact; returns {"records", "trainable", "path"}.

    `make_task(m, cfg, max_len)` builds the task for the loaded model and the data's row length;
    `loaded` injects a LoadedModel instead of loading cfg.model; `devices` restricts the mesh;
    `on_step(step)` is called after each optimizer step and its checkpoint; `progress`: None draws the
    bar on a terminal only and still prints the held-out lines, False prints nothing.
    """
    import orbax.checkpoint as ocp
    from s3djax import progress as progress_bar
    from s3djax.device import describe
    from s3djax.loading import open_model

    cpu_start = time.process_time()
    sharding.maybe_initialize_distributed()
    out = os.path.abspath(cfg.out)
    check_resumable(cfg, out)
    data, held_out = Shards(cfg.data, "train"), Shards(cfg.data, "eval")
    model = loaded or open_model(cfg.model, cfg.checkpoint)  # a header, until the checks pass
    if data.manifest["vocab_size"] > model.config.vocab_size:
        raise UserError(f"{cfg.data} was tokenized for a {data.manifest['vocab_size']}-token vocabulary; "
                        f"{model.name} has {model.config.vocab_size}")
    m = loaded or model.load(dtype="float32", progress=progress)
    task = make_task(m, cfg, data.tokens.shape[1])
    trainer = Trainer(cfg, task)
    mesh = sharding.make_mesh(devices)
    sharding.check_batch(cfg.batch_size, mesh)

    def place(tree):
        return jax.device_put(tree, sharding.param_sharding(mesh, tree, cfg.fsdp))

    trainable = task.init_trainable(m, cfg, jax.random.key(cfg.seed))
    trainable = jax.tree.map(lambda x: x.astype(jnp.float32), trainable)
    tx, lr = optimizer(cfg)
    state = place({"trainable": trainable, "opt_state": tx.init(trainable),
                   "micro_step": jnp.zeros((), jnp.int32)})
    frozen = place(jax.tree.map(lambda x: x.astype(trainer.dtype), m.params))

    mngr = ocp.CheckpointManager(os.path.join(out, "checkpoints"),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True))
    start = mngr.latest_step() or 0
    if start:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
    metrics = Metrics(os.path.join(out, "metrics.jsonl"), start)
    # CPU-hours of every process that trained the kept steps (to within a logging interval), this host's
    cpu_before = max((r.get("cpu_hours", 0.0) for r in metrics.records if r["split"] == "train"), default=0.0)

    def cpu_hours():
        return round(cpu_before + (time.process_time() - cpu_start) / 3600, 4)

    def evaluate(step):
        total = None
        for i in range(cfg.eval_batches):
            rows = held_out.rows(np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % len(held_out))
            sums = trainer.eval_step(state["trainable"], frozen, sharding.global_batch(rows, mesh), i)
            total = sums if total is None else jax.tree.map(jnp.add, total, sums)
        record = {"step": step, "split": "eval", **summarize(jax.device_get(total))}
        metrics.write(record)
        return record

    def export(step, record):
        """Write the artifact from the current state; every process must call it (multi-host gather)."""
        meta = {"model": m.name, "steps": step, "trained_on": describe(), "cpu_hours": cpu_hours(),
                "held_out_depth_acc": record["depth_acc"], "config": cfg.to_dict()}
        # Multi-host FSDP arrays are not all addressable here: gather them.
        trained = (multihost_utils.process_allgather(state["trainable"]) if jax.process_count() > 1
                   else jax.device_get(state["trainable"]))
        return trained, (task.export(out, trained, meta) if metrics.writer else None)

    def evals():
        return [r for r in metrics.records if r["split"] == "eval"]

    def best_eval():  # the first of the best, so a later tie does not displace it
        return max(evals(), key=acceptance)

    last = min(cfg.steps, cfg.stop_at or cfg.steps)  # a run cut short keeps the schedule of `steps`
    bar = progress_bar.bar(total=last, initial=min(start, last), desc="training", unit="step", show=progress)
    say = (lambda line: bar.write(line, file=sys.stderr)) if progress is not False else (lambda line: None)
    if start:
        say(f"resumed from step {start} in {out}")
    # With patience the artifact is the best held-out evaluation's state, exported when it is evaluated.
    best = None
    if start == 0:  # the untrained draft's figures start the held-out curve
        e = evaluate(0)
        say(f"step 0: held-out accuracy by depth {e['depth_acc']}")
        best = export(0, e) if cfg.patience else None
    window, tokens, tic = None, 0, time.perf_counter()
    stop, began = plateaued(evals(), cfg.patience), time.monotonic()
    try:
        for step in range(start + 1, last + 1):
            if stop:
                break
            for _ in range(cfg.grad_accum):
                micro = int(state["micro_step"])
                rows = data.batch(cfg.seed, micro, cfg.batch_size)
                state, loss, sums = trainer.train_step(state, frozen, sharding.global_batch(rows, mesh))
                window = sums if window is None else jax.tree.map(jnp.add, window, sums)
                tokens += int(rows["lengths"].sum())
            loss = float(loss)
            if not math.isfinite(loss):
                mngr.wait_until_finished()
                raise UserError(f"loss became {loss} at step {step}; stopping without saving. The last checkpoint "
                                f"(step {mngr.latest_step() or 'none'}) is intact: lower lr or use compute_dtype=float32")
            if step % cfg.log_every == 0 or step == last:
                s = summarize(jax.device_get(window))
                rate = tokens / (time.perf_counter() - tic)
                metrics.write({"step": step, "split": "train", "lr": float(lr(step)), "tokens_per_s": round(rate, 1),
                               "cpu_hours": cpu_hours(),
                               "epoch": round(data.epoch(micro + 1, cfg.batch_size), 4), **s})
                bar.set_postfix(loss=f"{s['loss']:.3f}", acc1=s["depth_acc"][0], tok_s=f"{rate:.0f}")
                if bar.disable:  # no bar to carry them: a log gets the metrics as a line
                    say(f"step {step}: loss {s['loss']:.3f}, accuracy by depth {s['depth_acc']}, {rate:.0f} tokens/s")
                window, tokens, tic = None, 0, time.perf_counter()
            timed_out = bool(cfg.stop_after_s) and time.monotonic() - began >= cfg.stop_after_s
            if step % cfg.eval_every == 0 or step == last or timed_out:
                e = evaluate(step)
                say(f"step {step}: held-out loss {e['loss']:.3f}, accuracy by depth {e['depth_acc']}")
                if cfg.patience and e is best_eval():
                    best = export(step, e)
                stop = plateaued(evals(), cfg.patience)
                if stop:
                    say(f"step {step}: stopping, {cfg.patience} held-out evaluations have not beaten step "
                        f"{best_eval()['step']}, whose state is the artifact")
            if timed_out and not stop:
                stop = True
                say(f"step {step}: stopping, stop_after_s ({cfg.stop_after_s:g} s) has passed; a rerun resumes here")
            if step % cfg.save_every == 0 or step == last or stop:
                mngr.save(step, args=ocp.args.StandardSave(state))
            bar.update()
            if on_step:
                on_step(step)
    finally:  # Ctrl-C or an error still lets the checkpoint under way finish
        bar.close()
        mngr.wait_until_finished()
    # Exported on every finishing run, so rerunning a finished command re-exports its draft; with patience, the
    # best state was exported when it was evaluated, unless that happened before a resume.
    done = min(int(state["micro_step"]) // cfg.grad_accum, last)
    final = evals()[-1] if evals() and evals()[-1]["step"] == done else evaluate(done)
    mngr.close()
    if best is None and cfg.patience and final is not best_eval():
        say(f"the best held-out state (step {best_eval()['step']}) was exported before this resume; "
            f"{out}/draft.npz is left as it is")
        best = (None, os.path.join(out, "draft.npz"))
    trained, path = best if best is not None else export(done, final)
    if metrics.writer:
        if not plot(metrics.records, os.path.join(out, "loss.png")):
            say("no loss.png: matplotlib is not installed (pip install matplotlib)")
    return {"records": metrics.records, "trainable": trained, "path": path}


def parser(module: str, doc: str):
    """Every training module's command line: `python -m train.MODULE --config FILE [key=value ...]`."""
    from s3djax.cli import Parser

    p = Parser(prog=f"python -m train.{module}", description=doc.split("\n\n")[0])
    p.add_argument("--config", help="a YAML file of settings (see configs/train/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings that override the file's")
    return p


def train_from_args(args, run_training, method: str) -> None:
    """Load the config and overrides, run `run_training(cfg)` and say where the artifact went."""
    cfg = TrainConfig.load(args.config, args.overrides)
    result = run_training(cfg)
    out, steps = result["path"], max(r["step"] for r in result["records"])
    print(f"trained {steps} steps; artifact -> {out} "
          f"(python -m infer.generate --method {method} --draft {out})")


def main(module: str, doc: str, make_task, method: str, argv=None) -> None:
    train_from_args(parser(module, doc).parse_args(argv), lambda cfg: train(cfg, make_task), method)
