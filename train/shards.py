"""Token shards written by train.prepare_data, read with NumPy alone (the GPU image has no `datasets`).

Batches are a pure function of (seed, micro-step): each epoch is a seeded permutation of the rows,
so a resumed run reads exactly the batches it would have read without the interruption.
"""

from __future__ import annotations

import json
import os

import numpy as np

from s3djax.errors import UserError

FORMAT = "s3djax-token-shards/1"


class Shards:
    def __init__(self, folder: str, split: str):
        path = os.path.join(folder, "manifest.json")
        if not os.path.isfile(path):
            raise UserError(f"no manifest.json in {folder}: run `python -m train.prepare_data --out {folder}` first")
        with open(path) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise UserError(f"{path} is not an s3djax token-shard manifest")
        info = self.manifest["splits"].get(split)
        if info is None or info["rows"] == 0:
            raise UserError(f"{folder} has no {split} rows")
        missing = [name for name in info["shards"] if not os.path.isfile(os.path.join(folder, name))]
        if missing:  # git keeps a distilled set's parts, not its shards
            answered = sum(each["rows"] for each in self.manifest["splits"].values())
            how = (f"rerun the `python -m train.distill --out {folder}` that made it with --prompts {answered}, "
                   "which rebuilds them from its parts" if "new_tokens" in self.manifest else
                   f"rerun `python -m train.prepare_data --out {folder}`")
            raise UserError(f"{folder} lacks its shard {missing[0]}: {how}")
        parts = {"tokens": [], "loss_mask": [], "lengths": []}
        for name in info["shards"]:
            with np.load(os.path.join(folder, name)) as f:
                for key in parts:
                    parts[key].append(f[key])
        self.tokens = np.concatenate(parts["tokens"]).astype(np.int32)
        self.loss_mask = np.concatenate(parts["loss_mask"]).astype(np.uint8)
        self.lengths = np.concatenate(parts["lengths"]).astype(np.int32)
        self._perm = (None, None)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, index) -> dict:
        return {"tokens": self.tokens[index], "loss_mask": self.loss_mask[index], "lengths": self.lengths[index]}

    def batch(self, seed: int, micro_step: int, batch_size: int) -> dict:
        """Micro-step k's rows: positions k*batch .. of the concatenated per-epoch permutations."""
        n = len(self)
        flat = np.arange(micro_step * batch_size, (micro_step + 1) * batch_size)
        epochs, offsets = np.divmod(flat, n)
        index = np.array([self._permutation(seed, int(e))[o] for e, o in zip(epochs, offsets)])
        return self.rows(index)

    def _permutation(self, seed: int, epoch: int):
        if self._perm[0] != (seed, epoch):
            self._perm = ((seed, epoch), np.random.default_rng([seed, epoch]).permutation(len(self)))
        return self._perm[1]

    def epoch(self, micro_step: int, batch_size: int) -> float:
        return micro_step * batch_size / len(self)
