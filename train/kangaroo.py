"""Train a Kangaroo adapter: python -m train.kangaroo --config configs/train/kangaroo-smollm2-cpu.yaml [key=value ...]

The adapter learns to map the target's layer-l exit states to the full model's next-token
distribution (`target: kl`, paper Eq. 3: soft cross-entropy against the target's probabilities), or to the
self-distilled answers' own tokens (`target: data`, no teacher pass). Only the adapter
trains; the target is frozen, so verified output is exactly the original model's.
Rerunning the same command resumes from the last checkpoint in `out`; a finished run re-exports.
Writes to `out`: checkpoints/, metrics.jsonl, loss.png, config.json and draft.npz (the adapter), the artifact
`python -m infer.generate --method kangaroo --draft` loads.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from s3djax.cli import run
from s3djax import cache as kv
from s3djax.config import ModelConfig
from s3djax.model import Decoder
from s3djax.speculative.draft_params import load_artifact
from s3djax.speculative.drafters.kangaroo import (adapter_hidden, check_adapter, check_exit_layer, deep_plan,
                                           default_exit_layer, draft_logits, init_adapter, shallow_plan)
from train.config import TrainConfig
from train import loop
from train.loop import train
from train.objectives import TARGETS, _cross_entropy, sample_anchors
from train.trainable import warm_start


def kangaroo_loss(adapter, params, batch, key, *, config: ModelConfig, exit_layer: int, num_positions: int,
                  target: str = "kl"):
    """(loss, sums) over `num_positions` positions per row drawn from those whose next token is trained on.
    q is the draft (layers 0..l-1, adapter, shared norm and head) with the adapter run causally over the whole
    sequence, as its cache sees the committed context at inference. Targets:
      "kl": sum_v -p_target(v) log q(v), the paper's Eq. 3, from a full teacher pass;
      "greedy": cross-entropy on the teacher's argmax;
      "data": cross-entropy on the data's next token. On self-distilled answers that token is the target's own
        float32 greedy choice, so this skips the teacher pass through the layers above the exit, most of a
        step's work on a CPU.

    sums: one head's "depth_loss", "depth_correct" (draft top-1 == the label: the teacher's argmax, or the data's
    token under "data"), "depth_count".
    """
    tokens, loss_mask, lengths = batch["tokens"], batch["loss_mask"], batch["lengths"]
    b, t = tokens.shape
    dtype = params["final_norm"]["scale"].dtype
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = kv.causal_mask(zeros, t, t)
    # One target pass in two halves: the exit states are its layer-l residual stream.
    shallow, deep, variables = (Decoder(config, shallow_plan(config.num_layers, exit_layer)),
                                Decoder(config, deep_plan(config.num_layers, exit_layer)), {"params": params})
    x = shallow.apply(variables, tokens, method="embed_tokens")
    exits, cache = shallow.apply(variables, x, positions, kv.init_cache(config, b, t, dtype), zeros, mask,
                                 method="run_layers")
    hidden, _ = adapter_hidden(adapter, jax.lax.stop_gradient(exits), kv.init_cache(config, b, t, dtype)[0], positions,
                               zeros, mask, config=config)
    at, valid = sample_anchors(key, loss_mask, lengths, num_positions)  # position i predicts token i + 1
    pick = lambda x: jnp.take_along_axis(x, at[..., None], axis=1)
    student = draft_logits(params, pick(hidden), config)
    if target == "data":
        label = jnp.take_along_axis(tokens, at + 1, axis=1)
    else:
        final, _ = deep.apply(variables, exits, positions, cache, zeros, mask, method="run_layers")
        teacher = jax.lax.stop_gradient(deep.apply(variables, pick(final), method="exit_logits"))
        label = jnp.argmax(teacher, axis=-1)
    if target == "kl":
        per = -jnp.sum(jax.nn.softmax(teacher) * jax.nn.log_softmax(student), axis=-1)
    elif target in ("greedy", "data"):
        per = _cross_entropy(student, label)
    else:
        raise ValueError(f"unknown target {target!r}; choose from {TARGETS}")
    weight = valid.astype(jnp.float32)
    correct = (jnp.argmax(student, axis=-1) == label).astype(jnp.float32)
    sums = {"depth_loss": jnp.sum(per * weight)[None], "depth_correct": jnp.sum(correct * weight)[None],
            "depth_count": jnp.sum(weight)[None]}
    return sums["depth_loss"][0] / jnp.maximum(sums["depth_count"][0], 1.0), sums


@dataclasses.dataclass(frozen=True)
class KangarooTask:
    config: ModelConfig
    exit_layer: int
    num_positions: int  # trained positions per row: anchor_fraction of the row length
    target: str
    name = "kangaroo"

    @classmethod
    def create(cls, m, cfg: TrainConfig, max_len: int) -> "KangarooTask":
        layers = m.config.num_layers
        return cls(m.config, check_exit_layer(cfg.exit_layer or default_exit_layer(layers), layers),
                   max(1, round(cfg.anchor_fraction * max_len)), cfg.objective("kl").target)

    def init_trainable(self, m, cfg: TrainConfig, key):
        # Layer l's attention: the layer the adapter stands in for, so training starts from a sensible map.
        # Copies: the trained state is donated each step, and must not alias the frozen params.
        def load(path):  # the kangaroo builder's own reading: nested, and checked against this model
            adapter, meta = load_artifact(path, jnp.float32, kind="Kangaroo adapter")
            return check_adapter(adapter, m.config, path), meta

        return warm_start(jax.tree.map(jnp.copy, init_adapter(m.params, m.config, self.exit_layer)), cfg.init_from,
                          f"a Kangaroo adapter for {m.config.arch} at hidden size {m.config.hidden_size}", load)

    def loss(self, trainable, frozen, batch, key):
        return kangaroo_loss(trainable, frozen, batch, key, config=self.config, exit_layer=self.exit_layer,
                             num_positions=self.num_positions, target=self.target)

    def export(self, out, trained, meta):
        from s3djax.speculative.draft_params import save_artifact

        path = os.path.join(out, "draft.npz")  # the name every training run exports, which the tooling reads
        save_artifact(path, trained, {**meta, "method": "kangaroo", "exit_layer": self.exit_layer, "target": self.target,
                                      "held_out_acc": meta["held_out_depth_acc"][0]})
        return path


def train_adapter(cfg: TrainConfig, **kwargs) -> dict:
    """`train.loop.train` for Kangaroo (kwargs: loaded, progress, devices, on_step)."""
    return train(cfg, KangarooTask.create, **kwargs)


def main(argv=None):
    loop.main("kangaroo", __doc__, KangarooTask.create, "kangaroo", argv)


if __name__ == "__main__":
    run(main)
