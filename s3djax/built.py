"""What a method builder returns, and the pieces the builders in `methods` and the drafters share.

Kept below both, so `methods` can import the drafters' builders and they can import these.
"""

from __future__ import annotations

import dataclasses
import os

from s3djax import quant
from s3djax.errors import UserError
from s3djax.loading import DTYPES, LoadedModel
from s3djax.model import with_layers
from s3djax.speculative.draft_params import load_draft


@dataclasses.dataclass
class Built:
    decoder: object
    params: object
    warnings: list[str]
    draft: str = ""  # which draft a speculative method uses, for the stats line


def finetuned_target(m: LoadedModel, layers: dict, dtype: str) -> dict:
    """The target with a full-mode S3D draft's fine-tuned layers in place, quantized like the rest."""
    params = with_layers(m.params, layers)
    return quant.apply(params, m.quant, DTYPES[dtype], m.matmul) if m.quant != "none" else params


def target_from(m: LoadedModel, path: str, dtype: str) -> tuple[dict, dict]:
    """--target-from: (the fine-tuned target's params, the fine-tuned layers) of a full-mode S3D draft file."""
    draft, _ = load_draft(path, m.config, DTYPES[dtype])
    if "layers" not in draft:
        raise UserError(f"--target-from {path} is not a full-mode s3d draft (it has no layers)")
    return finetuned_target(m, draft["layers"], dtype), draft["layers"]


def about_file(path: str | None, meta: dict) -> str:
    """How a stats line names a trained artifact."""
    if not meta:
        return "untrained"
    return (f"{os.path.relpath(path)} ({meta.get('mode', 'trained')}, {meta.get('steps', '?')} steps, trained on "
            f"{meta.get('trained_on', '?')})")
