"""One entry point from a model name or path to (config, params, tokenizer), with progress."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp

from s3djax import progress, quant, registry, tokenizer, weights
from s3djax.config import ModelConfig, default_attention
from s3djax.errors import UserError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    params: dict
    tokenizer: object
    load_s: float
    matmul: str = "xla"  # the int8 matmul, for weights quantized after loading (a full-mode draft's layers)

    @property
    def quant(self) -> str:
        return quant.mode_of(self.params)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The GGUF config's EOS ids and the tokenizer's: generation stops at any of them."""
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return tuple(sorted(set(self.config.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())))


def _with_progress(get, total: int, label: str, show: bool | None):
    bar = progress.bar(total=total, desc=f"loading {label}", unit="tensor", leave=False, show=show)

    def counted(name):
        out = get(name)
        bar.update()
        if bar.n == total:
            bar.close()
        return out

    return counted


def _resolve(name_or_path: str, checkpoint: str | None):
    """(registry entry or None, file or folder) for a registry name, .gguf file or checkpoint folder."""
    entry = None
    looks_like_path = os.sep in name_or_path or name_or_path.endswith(".gguf")
    if (looks_like_path or os.path.exists(name_or_path)) and checkpoint is None:
        path = name_or_path
    else:
        entry = registry.lookup(name_or_path)
        if entry.format == "gguf":
            path = checkpoint or entry.path()
        elif checkpoint is None:
            raise UserError(f"{entry.name} is a shape, not a shipped model: pass --checkpoint DIR "
                            "(a Hugging Face folder with config.json and *.safetensors)")
        else:
            path = checkpoint
    if not os.path.exists(path):
        raise UserError(f"no such file or folder: {path}")
    if not (path.endswith(".gguf") or os.path.isdir(path)):
        raise UserError(f"{path} is neither a .gguf file nor a checkpoint folder")
    return entry, path


@dataclasses.dataclass
class ModelSource:
    """A model found but not yet loaded: its config from the file's header, so every option can be
    checked before any weight is read; the tokenizer is built on first use. `name` and `config` read
    as a LoadedModel's do."""
    name: str
    path: str
    entry: registry.ModelEntry | None
    config: ModelConfig
    _tensors: object          # a getter of Hugging Face-named tensors, read lazily
    _gguf: object = None
    _tokenizer: object = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = tokenizer.from_gguf(self._gguf) if self._gguf else tokenizer.from_folder(self.path)
        return self._tokenizer

    def load(self, *, dtype: str = "float32", attention: str | None = None, quantization: str | None = None,
             matmul: str = "xla", progress: bool | None = None) -> LoadedModel:
        """The weights, read once. `quantization` (a `quant.MODES` name) converts them as they are read;
        None keeps them as stored. `matmul` picks the int8 matmul (`quant.KERNELS`)."""
        check_load_options(dtype, quantization, matmul)
        start = time.perf_counter()
        # The tokenizer is built on a second thread when it is not built yet: it is mostly transformers'
        # import, which overlaps well with dequantizing weights in NumPy.
        with ThreadPoolExecutor(1) as pool:
            tok = pool.submit(lambda: self.tokenizer)
            config = self.config.replace(attention=attention or default_attention())
            params = weights.from_hf_tensors(_with_progress(self._tensors, weights.num_tensors(config), self.name, progress),
                                             config, DTYPES[dtype], quantization, matmul)
            tok = tok.result()
        return LoadedModel(self.name, config, params, tok, time.perf_counter() - start, matmul)


def check_load_options(dtype: str, quantization: str | None, matmul: str) -> None:
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    quant.check_mode(quantization or "none", matmul)


def open_model(name_or_path: str, checkpoint: str | None = None) -> ModelSource:
    """`name_or_path`: a registry name, a .gguf file, or a Hugging Face checkpoint folder. Registry
    shapes without a shipped file (llama-2-7b, ...) need `checkpoint`, and the folder is checked
    against the shape. Reads headers only, once per file version: parsing SmolLM2's GGUF header
    (its 49k-token vocabulary) and building its tokenizer take seconds."""
    entry, path = _resolve(name_or_path, checkpoint)
    return _open(entry.name if entry else None, path, os.path.getmtime(path))


@functools.lru_cache(maxsize=4)
def _open(entry_name: str | None, path: str, mtime: float) -> ModelSource:
    entry = registry.lookup(entry_name) if entry_name else None
    label = entry.name if entry else os.path.basename(os.path.normpath(path))
    gf = weights.GGUFFile(path) if path.endswith(".gguf") else None
    config, get = (gf.config(), None) if gf else weights.open_hf_folder(path)
    if entry:
        entry.check_shape(config, path)
    return ModelSource(label, path, entry, config, get or gf.hf_tensor(config), gf)


def load_tokenizer(name_or_path: str, checkpoint: str | None = None):
    """The tokenizer alone (data preparation needs no weights)."""
    return open_model(name_or_path, checkpoint).tokenizer


def load_model(name_or_path: str, *, dtype: str = "float32", checkpoint: str | None = None,
               attention: str | None = None, quantization: str | None = None, matmul: str = "xla",
               progress: bool | None = None) -> LoadedModel:
    """`open_model(name_or_path, checkpoint).load(...)`; `progress`: None draws the bar only on a terminal."""
    check_load_options(dtype, quantization, matmul)
    return open_model(name_or_path, checkpoint).load(dtype=dtype, attention=attention, quantization=quantization,
                                                     matmul=matmul, progress=progress)
