"""Train an S3D draft: python -m train.s3d --config configs/train/s3d-smollm2.yaml [key=value ...]

Rerunning the same command resumes from the last checkpoint in `out` (same step, same data
position, optimizer state restored); a finished run just re-exports its draft.
Writes to `out`: checkpoints/, metrics.jsonl, loss.png, config.json and draft.npz, the artifact
`python -m infer.generate --method s3d --draft` loads.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from s3djax.cli import run
from s3djax.config import ModelConfig
from s3djax.skip_plan import SkipPlan
from s3djax.speculative.correction import init_correction
from train.config import TrainConfig
from train import loop
from train.objectives import s3d_loss
from train.trainable import assemble, init_trainable, warm_start


def draft_plan(cfg: TrainConfig, num_layers: int) -> SkipPlan:
    from s3djax.speculative.drafters.s3d import default_plan

    return SkipPlan.parse(cfg.skip, num_layers) if cfg.skip else default_plan(num_layers)


@dataclasses.dataclass(frozen=True)
class S3DTask:
    cfg: TrainConfig
    config: ModelConfig
    plan: SkipPlan
    num_anchors: int
    name = "s3d"

    @classmethod
    def create(cls, m, cfg: TrainConfig, max_len: int) -> "S3DTask":
        return cls(cfg.objective("data"), m.config, draft_plan(cfg, m.config.num_layers),
                   max(1, round(cfg.anchor_fraction * max_len)))

    def init_trainable(self, m, cfg: TrainConfig, key):
        from s3djax.speculative.draft_params import load_draft

        fresh = init_trainable(m.params, m.config, self.plan, cfg.mode, cfg.lora_rank, key)
        if cfg.correction_rank:
            fresh["correction"] = init_correction(m.config.hidden_size, cfg.correction_rank, jax.random.fold_in(key, 1))
        return warm_start(fresh, cfg.init_from, f"a {cfg.mode} draft of this plan, LoRA rank and correction rank",
                          lambda path: load_draft(path, m.config, jnp.float32))

    def loss(self, trainable, frozen, batch, key):
        params, draft = assemble(trainable, frozen)
        cfg = self.cfg
        if cfg.freeze_draft:  # no gradient reaches the layers, so none flows back through them
            draft = {k: v if k == "correction" else jax.lax.stop_gradient(v) for k, v in draft.items()}
        return s3d_loss(params, draft, batch, key, config=self.config, plan=self.plan, gamma=cfg.gamma,
                        num_anchors=self.num_anchors, target=cfg.target,
                        lm_weight=cfg.lm_weight if cfg.mode == "full" else 0.0)

    def export(self, out, trained, meta):
        from s3djax.speculative.draft_params import save_draft

        path = os.path.join(out, "draft.npz")
        cfg = self.cfg
        save_draft(path, trained, {**meta, "skip": self.plan.spec(), "gamma": cfg.gamma, "mode": cfg.mode,
                                   "lora_rank": cfg.lora_rank, "correction_rank": cfg.correction_rank,
                                   "target": cfg.target})
        return path


def train_draft(cfg: TrainConfig, **kwargs) -> dict:
    """`train.loop.train` for S3D (kwargs: loaded, progress, devices, on_step)."""
    return loop.train(cfg, S3DTask.create, **kwargs)


def main(argv=None):
    loop.main("s3d", __doc__, S3DTask.create, "s3d", argv)


if __name__ == "__main__":
    run(main)
