"""Sorted fine-tuning (SoFT) of S2D's nested draft, and the sweep of its exit thresholds.

    python -m train.s2d --config configs/train/s2d-smollm2-cpu.yaml [key=value ...]
    python -m train.s2d --sweep DRAFT.npz [--target-from FULL_MODE_S3D.npz] [--report FILE.md]

Training: the first N_d layers (the last of cfg.exits) run causally over whole ShareGPT rows with
rank-cfg.lora_rank LoRA adapters on every linear; after each exit the shared final norm and LM head
give next-token logits, and the loss is the mean of the exits' losses (the paper's Eq. 3). The
base model stays frozen, so the artifact (draft.npz in `out`) is the adapters alone. The exits are
scored at cfg.anchor_fraction of each row's positions (the heads are the costly part). Per-exit
targets follow cfg.target: "data" is the paper's next data token, "greedy"/"kl" distil the full
model's own prediction, which is what greedy verification accepts. Rerunning resumes (train.loop).

The sweep decodes a few MT-Bench prompts greedily with each threshold setting against each target
(bfloat16, int8, and the full-mode S3D target when given), keeps the fastest setting per target in
the artifact's metadata (`thresholds`, which `--method s2d` reads when --thresholds is not given)
and writes a table of tokens/s, tau and exit use.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from s3djax.cli import run
from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.model import Decoder, forward_sequence
from s3djax.speculative.drafters.s2d import run_segment
from s3djax.speculative.drafters.s2d_artifact import ARTIFACT_KIND, init_lora, parse_exits
from train.config import TrainConfig
from train import loop
from train.loop import train
from train.objectives import _cross_entropy, sample_anchors
from train.trainable import warm_start


def exit_hidden(params, lora, tokens, *, config: ModelConfig, exits: tuple[int, ...]):
    """The draft's residual stream after each exit: a list of [B, T, D], the layers run causally."""
    b, t = tokens.shape
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = kv.init_cache(config.replace(num_layers=exits[-1]), b, t, params["embed"].dtype)
    mask = kv.causal_mask(zeros, t, t)
    x, out, lo = Decoder(config).apply({"params": params}, tokens, method="embed_tokens"), [], 0
    for hi in exits:
        x, _ = run_segment(config, params, lo, hi, x, positions, cache[lo:hi], zeros, mask, lora=lora)
        out.append(x)
        lo = hi
    return out


def soft_loss(params, lora, batch, key, *, config: ModelConfig, exits: tuple[int, ...], num_positions: int,
              target: str = "data"):
    """(mean over exits of each exit's mean next-token loss, per-exit sums).

    The layers run over whole rows; the exits are scored at `num_positions` positions per row drawn
    among those whose next token is trained on (the heads, 49k wide, would otherwise cost more than
    the layers). sums: "depth_loss", "depth_correct" (exit top-1 == the label: the full model's greedy
    token, or under "data" the data's token, which on self-distilled answers is the same),
    "depth_count", one entry per exit, summed over the batch so accumulation adds up.
    """
    tokens, loss_mask, lengths = batch["tokens"], batch["loss_mask"], batch["lengths"]
    at, valid = sample_anchors(key, loss_mask, lengths, num_positions)   # [B, A]: position at predicts at + 1
    weight = valid.astype(jnp.float32)
    pick = lambda h: jnp.take_along_axis(h, at[..., None], axis=1)
    decoder, variables = Decoder(config), {"params": params}
    if target == "data":
        # On self-distilled answers the data's token is the target's own float32 greedy choice, so the teacher
        # pass through all the layers, most of a step's work on a CPU, is not needed.
        labels = greedy = jnp.take_along_axis(tokens, at + 1, axis=1)
    else:
        full_hidden, _ = forward_sequence(params, tokens, config=config)
        full = jax.lax.stop_gradient(decoder.apply(variables, pick(full_hidden), method="logits"))
        greedy = jnp.argmax(full, axis=-1)
        labels = greedy if target == "greedy" else None
    sums = {"depth_loss": [], "depth_correct": [], "depth_count": []}
    for h in exit_hidden(params, lora, tokens, config=config, exits=exits):
        logits = decoder.apply(variables, pick(h), method="exit_logits")
        if labels is not None:
            per = _cross_entropy(logits, labels)
        else:  # kl: KL(p_full || q_exit), written without log q so no 0 * -inf appears
            p = jax.nn.softmax(full)
            entropy = jnp.sum(jnp.where(p > 0, p * jax.nn.log_softmax(full), 0.0), axis=-1)
            per = entropy + jax.nn.logsumexp(logits, axis=-1) - jnp.sum(p * logits, axis=-1)
        sums["depth_loss"].append(jnp.sum(per * weight))
        sums["depth_correct"].append(jnp.sum((jnp.argmax(logits, axis=-1) == greedy) * weight))
        sums["depth_count"].append(jnp.sum(weight))
    sums = {k: jnp.stack(v) for k, v in sums.items()}
    # Every exit counts the same positions, so this is Eq. 3's mean of the exits' mean losses.
    return jnp.sum(sums["depth_loss"]) / jnp.maximum(jnp.sum(sums["depth_count"]), 1.0), sums


@dataclasses.dataclass(frozen=True)
class S2DTask:
    cfg: TrainConfig
    config: ModelConfig
    exits: tuple[int, ...]
    num_positions: int  # scored positions per row
    name = "s2d"

    @classmethod
    def create(cls, m, cfg: TrainConfig, max_len: int) -> "S2DTask":
        return cls(cfg.objective("data"), m.config, parse_exits(cfg.exits, m.config.num_layers),
                   max(1, round(cfg.anchor_fraction * max_len)))

    def init_trainable(self, m, cfg: TrainConfig, key):
        return warm_start({"lora": init_lora(m.params, m.config, self.exits[-1], cfg.lora_rank, key)}, cfg.init_from,
                          f"an S2D nested draft of depth {self.exits[-1]} and LoRA rank {cfg.lora_rank}")

    def loss(self, trainable, frozen, batch, key):
        return soft_loss(frozen, trainable["lora"], batch, key, config=self.config, exits=self.exits,
                         num_positions=self.num_positions, target=self.cfg.target)

    def export(self, out, trained, meta):
        from s3djax.speculative.draft_params import save_artifact

        path = os.path.join(out, "draft.npz")
        save_artifact(path, {"lora": trained["lora"]},
                      {**meta, "method": "s2d", "exits": list(self.exits), "lora_rank": self.cfg.lora_rank,
                       "target": self.cfg.target, "thresholds": {}})
        return path


def train_nested(cfg: TrainConfig, **kwargs) -> dict:
    """`train.loop.train` for S2D (kwargs: loaded, progress, devices, on_step)."""
    if cfg.lora_rank < 1:
        from s3djax.errors import UserError

        raise UserError("s2d trains LoRA adapters only: lora_rank must be at least 1")
    return train(cfg, S2DTask.create, **kwargs)


# ------------------------------------------------------------------------------ threshold sweep

SETTINGS = ("1.01,1.01", "0.9,0.8", "0.8,0.6", "0.6,0.4", "0.4,0.2", "0,0")  # 1.01: that exit is off


def sweep(draft_path: str, *, target_from: str | None = None, settings=SETTINGS, prompts: int = 3,
          max_new_tokens: int = 48, max_cache_len: int = 512, progress=print) -> dict:
    """{target key: [{"thresholds", "tokens_per_s", "tau", "exit_share"}, ...]} over MT-Bench prompts.

    One executable per target serves every setting (thresholds are traced); the order of settings
    rotates per prompt so that load drift on a shared machine falls on all of them alike.
    """
    from s3djax import methods
    from s3djax.bench_data import mt_bench
    from s3djax.decode import bucket
    from s3djax.loading import load_model
    from s3djax.speculative.drafters.s2d_artifact import target_key
    from s3djax.tokenizer import encode_prompt

    targets = [("bfloat16", dict(dtype="bfloat16"), None), ("int8", dict(dtype="bfloat16", quantization="int8"), None)]
    if target_from:
        targets.append(("full-mode", dict(dtype="bfloat16"), target_from))
    from s3djax.speculative.draft_params import load_artifact

    model_name, results = load_artifact(draft_path, jnp.float32, ARTIFACT_KIND)[1].get("model", "smollm2-135m"), {}
    for name, load, tf in targets:
        m = load_model(model_name, progress=False, **load)
        assert target_key(m.quant, load["dtype"], tf is not None) == name
        # lookup=0: the sweep times S2D's own exits, which prompt lookup's steps would dilute.
        built = {s: methods.build("s2d", m, max_cache_len=max_cache_len, dtype=load["dtype"], draft_path=draft_path,
                                  thresholds=s, target_from=tf, lookup=0) for s in settings}
        decoder = built[settings[0]].decoder
        start, decode = jax.jit(decoder.start), jax.jit(decoder.decode)
        runs = {s: [] for s in settings}
        for i, q in enumerate(mt_bench()[:prompts]):
            ids = encode_prompt(m.tokenizer, q["turns"][0], chat_template=True)
            prompt = np.full((1, bucket(len(ids), max_cache_len)), decoder.pad_id, np.int32)
            prompt[0, :len(ids)] = ids
            args = (jnp.asarray(prompt), jnp.asarray([len(ids)], jnp.int32), jax.random.key(0))
            if i == 0:  # compile outside the timings
                jax.block_until_ready(decode(built[settings[0]].params, start(built[settings[0]].params, *args), 2))
            for s in settings[i % len(settings):] + settings[:i % len(settings)]:
                params = built[s].params
                state = jax.block_until_ready(start(params, *args))
                t = time.perf_counter()
                state = jax.block_until_ready(decode(params, state, jnp.int32(max_new_tokens)))
                runs[s].append((time.perf_counter() - t, min(int(state["step"]), max_new_tokens) - 1,
                                decoder.stats(state)["accepted_per_step"], np.asarray(state["drafter"]["exit_counts"])))
        rows = []
        for s in settings:
            seconds, tokens, accepted, exits = zip(*runs[s])
            accepted, exits = sum(accepted, []), np.sum(exits, axis=0)
            rows.append({"thresholds": s, "tokens_per_s": round(sum(tokens) / sum(seconds), 2),
                         "tau": round(float(np.mean(accepted)) + 1, 3),
                         "exit_share": (exits / max(exits.sum(), 1)).round(3).tolist()})
        results[name] = rows
        progress(f"{name}: " + "; ".join(f"{r['thresholds']} -> {r['tokens_per_s']} tok/s, tau {r['tau']}, "
                                         f"exits {r['exit_share']}" for r in rows))
    return results


def store_thresholds(draft_path: str, chosen: dict) -> None:
    """Rewrite the artifact with `chosen` {target key: [thresholds]} in its metadata."""
    from s3djax.speculative.draft_params import load_artifact, save_artifact

    tree, meta = load_artifact(draft_path, jnp.float32, ARTIFACT_KIND)
    save_artifact(draft_path, tree, {**meta, "thresholds": {**meta.get("thresholds", {}), **chosen}})


def write_report(path: str, draft_path: str, results: dict, chosen: dict, args) -> None:
    from s3djax.device import describe

    lines = ["# S2D exit thresholds, swept per target", "",
             f"- device: {describe()}", f"- date: {datetime.date.today()}",
             f"- draft: {os.path.relpath(draft_path)}; {args.prompts} MT-Bench prompts x {args.max_new_tokens} new "
             "tokens, greedy, chain of 6, bfloat16 activations; thresholds for exits 4 and 6 (the deepest exit, 8, "
             "always stops; 1.01 switches an exit off)",
             "- pick: the fastest setting per target, stored in the artifact's metadata (`thresholds`); float32 "
             "takes bfloat16's pick (the same weights)",
             f"- command: `python -m train.s2d --sweep {os.path.relpath(draft_path)}"
             + (f" --target-from {args.target_from}" if args.target_from else "") + "`",
             "- exit use counts every drafted token; the depth-1 token always comes from exit 8 (block 0 runs the "
             "committed tail at full depth), so exit 8 has at least 1/6 of a chain of 6", "",
             "| target | thresholds | tokens/s | tau | drafted tokens per exit 4 / 6 / 8 | picked |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, rows in results.items():
        for r in rows:
            mark = "yes" if [float(x) for x in r["thresholds"].split(",")] == chosen[name] else ""
            share = " / ".join(f"{x:.2f}" for x in r["exit_share"])
            lines.append(f"| {name} | {r['thresholds']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | {share} | {mark} |")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    p = loop.parser("s2d", __doc__)
    p.add_argument("--sweep", metavar="DRAFT", help="sweep the exit thresholds of this trained draft instead")
    p.add_argument("--target-from", help="sweep: also the full-mode S3D target of this draft file")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--report", help="sweep: write the table to this Markdown file")
    args = p.parse_args(argv)
    if args.sweep:
        results = sweep(args.sweep, target_from=args.target_from, prompts=args.prompts,
                        max_new_tokens=args.max_new_tokens)
        chosen = {name: [float(x) for x in max(rows, key=lambda r: r["tokens_per_s"])["thresholds"].split(",")]
                  for name, rows in results.items()}
        chosen["float32"] = chosen["bfloat16"]
        store_thresholds(args.sweep, chosen)
        if args.report:
            write_report(args.report, args.sweep, results, chosen, args)
        print(f"thresholds per target -> {args.sweep}: {chosen}")
        return
    loop.train_from_args(args, train_nested, "s2d")


if __name__ == "__main__":
    run(main)
