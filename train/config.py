"""Training settings: a YAML file validated into a frozen dataclass, with key=value overrides."""

from __future__ import annotations

import dataclasses
import os
import typing

import yaml

from s3djax.errors import UserError

MODES = ("lossless", "full")
SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "smollm2-135m"
    checkpoint: str | None = None    # weights for a registry shape (llama-2-7b, ...)
    data: str = "data/sharegpt-smollm2"
    out: str = "runs/s3d-smollm2"
    mode: str = "lossless"           # lossless: draft-only parameters | full: kept layers train too
    skip: str = ""                   # layers the draft skips; "" is the symmetric-middle default
    gamma: int = 4
    lora_rank: int = 16              # lossless mode's adapters on the kept sub-layers; 0 trains <M> only
    target: str = ""                 # data | greedy | kl (distil the full model); "": the method's paper's
    lm_weight: float = 1.0           # full mode: weight of the next-token term that keeps the target good
    anchor_fraction: float = 0.15
    init_from: str | None = None     # a draft file of the same shape to start from (warm start)
    correction_rank: int = 0         # s3d: the previous-token correction's rank (0: none)
    freeze_draft: bool = False       # s3d: train the correction only; init_from's mask token and adapters stay
    exit_layer: int = 0              # kangaroo: the early-exit layer (0: the method's default)
    exits: str = "4,6,8"             # s2d: the nested draft's exits, in layers (the last is its depth)
    batch_size: int = 8
    grad_accum: int = 1
    steps: int = 1000                # optimizer steps (the schedule's length)
    stop_at: int = 0                 # stop and export at this step instead (0: at `steps`); the schedule is kept
    patience: int = 0                # stop once this many held-out evaluations in a row have not beaten the best (0: off)
    stop_after_s: float = 0.0        # stop, save and export once this process has trained this long (0: off): a lease
    lr: float = 3e-5
    warmup_steps: int = 50
    schedule: str = "cosine"
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    compute_dtype: str = "bfloat16"  # the optimizer state and trained parameters stay float32
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    eval_answer_tokens: int = 0      # held-out agreement over each answer's first N tokens, what a benchmark decodes (0: all)
    save_every: int = 200
    keep: int = 3
    fsdp: bool = False

    def __post_init__(self):
        from train.objectives import TARGETS

        checks = [(self.mode in MODES, f"mode must be one of {', '.join(MODES)}"),
                  (self.target in ("",) + TARGETS, f"target must be one of {', '.join(TARGETS)}"),
                  (self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}"),
                  (self.compute_dtype in ("bfloat16", "float32"), "compute_dtype must be bfloat16 or float32"),
                  (self.gamma >= 1, "gamma must be at least 1"),
                  (0 < self.anchor_fraction <= 1, "anchor_fraction must be in (0, 1]"),
                  (min(self.batch_size, self.grad_accum, self.steps, self.log_every, self.eval_every,
                       self.save_every, self.keep) >= 1 and min(self.patience, self.stop_after_s) >= 0,
                   "batch_size, grad_accum, steps and the intervals must be at least 1, patience and stop_after_s "
                   "at least 0"),
                  (self.eval_answer_tokens >= 0, "eval_answer_tokens must not be negative"),
                  (self.lr > 0 and min(self.lora_rank, self.correction_rank, self.warmup_steps) >= 0,
                   "lr, lora_rank, correction_rank and warmup_steps must not be negative"),
                  (not self.freeze_draft or (self.correction_rank and self.init_from and self.mode == "lossless"),
                   "freeze_draft trains a correction (correction_rank) on a lossless draft given by init_from")]
        for ok, message in checks:
            if not ok:
                raise UserError(f"invalid training config: {message}")

    def objective(self, paper: str) -> "TrainConfig":
        """This config with the method's paper objective as its target where it names none: the
        artifact's metadata then records what was trained."""
        return self if self.target else dataclasses.replace(self, target=paper)

    @classmethod
    def load(cls, path: str | None, overrides: list[str] = ()) -> "TrainConfig":
        values = {}
        if path:
            if not os.path.isfile(path):
                raise UserError(f"no such config file: {path}")
            with open(path) as f:
                values = yaml.safe_load(f) or {}
            if not isinstance(values, dict):
                raise UserError(f"{path} must be a mapping of settings")
        for item in overrides:
            key, eq, value = item.partition("=")
            if not eq:
                raise UserError(f"override {item!r} is not key=value")
            values[key.strip()] = yaml.safe_load(value)
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(values) - set(fields)
        if unknown:
            raise UserError(f"unknown training settings {sorted(unknown)}; known: {', '.join(fields)}")
        hints = typing.get_type_hints(cls)
        for key, value in values.items():
            want = hints[key]
            kinds = typing.get_args(want) or (want,)
            if float in kinds and isinstance(value, int) and not isinstance(value, bool):
                values[key] = value = float(value)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise UserError(f"training setting {key}={value!r} should be {want}")
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Settings a resumed run may change without changing what it computes.
RESUMABLE_CHANGES = {"out", "log_every", "eval_every", "eval_batches", "save_every", "keep", "data", "stop_at", "patience", "stop_after_s"}
