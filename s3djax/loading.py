"""One entry point from a model name or path to (config, params, tokenizer), with progress."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp

from s3djax import quant, registry, tokenizer, weights
from s3djax.config import ModelConfig
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


def _with_progress(get, total: int, label: str, show: bool):
    if not show:
        return get
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"loading {label}", unit="tensor", file=sys.stderr, leave=False)

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


def load_tokenizer(name_or_path: str, checkpoint: str | None = None):
    """The tokenizer alone (data preparation needs no weights)."""
    _, path = _resolve(name_or_path, checkpoint)
    return tokenizer.from_gguf(weights.GGUFFile(path)) if path.endswith(".gguf") else tokenizer.from_folder(path)


def load_model(name_or_path: str, *, dtype: str = "float32", checkpoint: str | None = None,
               attention: str = "xla", quantization: str | None = None, matmul: str = "xla",
               progress: bool = True) -> LoadedModel:
    """`name_or_path`: a registry name, a .gguf file, or a Hugging Face checkpoint folder.

    Registry shapes without a shipped file (llama-2-7b, ...) need `checkpoint`, and the folder is
    checked against the shape. `quantization` (a `quant.MODES` name) converts weights as they are
    read; None keeps them as stored. `matmul` picks the int8 matmul (`quant.KERNELS`).
    """
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    quant.check_mode(quantization or "none", matmul)
    start = time.perf_counter()
    entry, path = _resolve(name_or_path, checkpoint)
    label = entry.name if entry else os.path.basename(os.path.normpath(path))
    # The tokenizer is built on a second thread: it is mostly transformers' import, which
    # overlaps well with dequantizing weights in NumPy.
    pool = ThreadPoolExecutor(1)
    if path.endswith(".gguf"):
        gf = weights.GGUFFile(path)
        config = gf.config()
        get = gf.hf_tensor(config)
        tok = pool.submit(tokenizer.from_gguf, gf)
    else:
        config, get = weights.open_hf_folder(path)
        tok = pool.submit(tokenizer.from_folder, path)
    if entry:
        entry.check_shape(config, path)
    config = config.replace(attention=attention)
    params = weights.from_hf_tensors(_with_progress(get, weights.num_tensors(config), label, progress), config,
                                     DTYPES[dtype], quantization, matmul)
    tok = tok.result()
    pool.shutdown()
    return LoadedModel(label, config, params, tok, time.perf_counter() - start, matmul)
