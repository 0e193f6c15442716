"""Checkpoints in, params pytree out: Hugging Face folders (config.json + safetensors) and GGUF.

Both formats go through the same Hugging Face tensor names (`from_hf_tensors`), so there is one
mapping onto our layout; GGUF is first renamed (and llama.cpp's q/k row permutation undone).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np

from s3djax import quant
from s3djax.config import ModelConfig, RopeScaling
from s3djax.errors import UserError
from s3djax.model import layer_key

_LAYER = "model.layers.{}."
QUANT_METHOD = "s3djax-int8"
# The one weight-name mapping: a path in our params tree -> (Hugging Face name, kind). Linears are
# stored [out, in] there and [in, out] here; tables are [V, D] in both.
_GLOBAL = {("embed",): ("model.embed_tokens", "table"), ("final_norm", "scale"): ("model.norm", "vector"),
           ("lm_head",): ("lm_head", "table")}
_LLAMA_LAYER = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
                ("attn", "v"): "self_attn.v_proj", ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj"}
_PHI3_LAYER = {("attn", "qkv"): "self_attn.qkv_proj", ("mlp", "gate_up"): "mlp.gate_up_proj"}
_SHARED_LAYER = {("attn", "o"): "self_attn.o_proj", ("mlp", "down"): "mlp.down_proj"}
_NORMS = {("attn_norm", "scale"): "input_layernorm", ("mlp_norm", "scale"): "post_attention_layernorm"}


def hf_names(config: ModelConfig) -> dict[tuple[str, ...], tuple[str, str]]:
    """Every params-tree path of this model -> (its Hugging Face tensor name, "linear" | "table" | "vector")."""
    names = {path: (name + ".weight", kind) for path, (name, kind) in _GLOBAL.items()
             if path != ("lm_head",) or not config.tie_word_embeddings}
    linears = {**(_PHI3_LAYER if config.arch == "phi3" else _LLAMA_LAYER), **_SHARED_LAYER}
    for i in range(config.num_layers):
        for kind, table_ in (("linear", linears), ("vector", _NORMS)):
            for path, theirs in table_.items():
                names[(layer_key(i),) + path] = (_LAYER.format(i) + theirs + ".weight", kind)
    return names


def num_tensors(config: ModelConfig) -> int:
    """How many tensors `from_hf_tensors` reads (for progress bars)."""
    return len(hf_names(config))


def from_hf_tensors(get: Callable[[str], np.ndarray], config: ModelConfig, dtype=jnp.float32,
                    quantization: str | None = None, kernel: str = "xla") -> dict:
    """Build params from a getter of Hugging Face-named tensors ([out, in] linears), one at a time.

    quantization: None keeps each weight as the checkpoint stores it; a `quant.MODES` name converts
    each tensor as it is read (quantize on load), so a float copy of the whole model never exists.
    """
    params: dict = {}
    for path, (name, kind) in hf_names(config).items():
        w = get(name)
        stored = isinstance(w, quant.Int8Weight)
        if kind == "linear":  # HF stores [out, in]; we multiply x @ w with w [in, out]
            w = quant.linear(w.T, quantization or ("int8" if stored else "none"), dtype, kernel)
        elif kind == "table":
            w = quant.table(w, quantization or ("int8-all" if stored else "none"), dtype, kernel)
        else:
            w = jnp.asarray(w, dtype)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = w
    return params


def to_hf_tensors(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of `from_hf_tensors`: float weights in fp32, int8 ones as int8 `.weight` plus a
    `.weight_scale` per output channel (the layout `open_hf_folder` reads back)."""
    out = {}
    for path, (name, kind) in hf_names(config).items():
        w = params
        for key in path:
            w = w[key]
        if isinstance(w, quant.Int8Weight):
            w = w.T if kind == "linear" else w
            out[name], out[name.removesuffix(".weight") + ".weight_scale"] = np.asarray(w.values), np.asarray(w.scale)
        else:
            w = np.asarray(jnp.asarray(w, jnp.float32))
            out[name] = w.T if kind == "linear" else w
    return out


def save_hf_folder(path: str, config: ModelConfig, params: dict, tokenizer) -> None:
    """A checkpoint folder `open_hf_folder` reads: config.json, model.safetensors and the tokenizer.

    Quantized params record themselves under `quantization_config`, as Hugging Face's quantized
    checkpoints do; only s3djax reads this format.
    """
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    hf = config.to_hf()
    mode = quant.mode_of(params)
    if mode != "none":
        hf["quantization_config"] = {"quant_method": QUANT_METHOD, "mode": mode}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    save_file({k: np.ascontiguousarray(v) for k, v in to_hf_tensors(params, config).items()},
              os.path.join(path, "model.safetensors"))
    tokenizer.save_pretrained(path)


def open_hf_folder(path: str) -> tuple[ModelConfig, Callable[[str], np.ndarray]]:
    """The folder's config and a getter of its tensors by Hugging Face name (read lazily)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise UserError(f"{path} is not a Hugging Face checkpoint folder: it has no config.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UserError(f"{path} has no *.safetensors weights (s3djax reads safetensors, not .bin)")
    with open(config_file) as f:
        hf = json.load(f)
    method = (hf.get("quantization_config") or {}).get("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise UserError(f"{path} is quantized with {method!r}; s3djax reads float checkpoints and its own "
                        f"int8 ({QUANT_METHOD}), and quantizes on load with --quant int8")
    config = ModelConfig.from_hf(hf)
    from safetensors import safe_open

    # "flax" rather than "numpy": NumPy has no bfloat16, and most checkpoints are bf16.
    handles = [safe_open(file, framework="flax") for file in files]
    where = {name: h for h in handles for name in h.keys()}

    def get(name):
        if name not in where:
            raise UserError(f"checkpoint {path} lacks tensor {name}")
        tensor = where[name].get_tensor(name)
        scale = name + "_scale"  # an s3djax int8 weight: [out, in] values, a scale per output row
        return quant.Int8Weight(tensor, where[scale].get_tensor(scale), axis=0) if scale in where else tensor

    if "lm_head.weight" not in where:
        config = config.replace(tie_word_embeddings=True)
    return config, get


def load_hf_folder(path: str, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    config, get = open_hf_folder(path)
    return config, from_hf_tensors(get, config, dtype)


# ----------------------------------------------------------------------------------------- GGUF

_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj"}


def _gguf_to_hf_name(name: str, arch: str) -> str | None:
    stem = name.removesuffix(".weight")
    if stem in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[stem] + ".weight"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return None
    if parts[2] == "ffn_up":  # Phi-3 ships gate and up fused in the tensor llama.cpp calls ffn_up
        theirs = "mlp.gate_up_proj" if arch == "phi3" else "mlp.up_proj"
    else:
        theirs = _GGUF_LAYER.get(parts[2])
    return theirs and f"{_LAYER.format(parts[1])}{theirs}.weight"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order for q/k so rotate-half RoPE applies."""
    out_dim, in_dim = w.shape
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


class GGUFFile:
    """A parsed GGUF: metadata fields, and tensors dequantized to fp32 on request."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise UserError(f"no such GGUF file: {path}")
        import gguf

        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # gguf raises plain ValueError/struct errors on a bad file
            raise UserError(f"{path} is not a readable GGUF file ({e})") from None
        self.path = path
        self.arch = self.field("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config(self) -> ModelConfig:
        a = self.arch
        if a not in ("llama", "phi3"):
            raise UserError(f"{self.path}: GGUF architecture {a!r} is not supported (llama, phi3 are)")
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        head_dim = self.field(f"{a}.attention.key_length") or hidden // heads
        rotary = self.field(f"{a}.rope.dimension_count", head_dim)
        eos = self.field("tokenizer.ggml.eos_token_id")
        vocab = self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        return ModelConfig(
            arch=a,
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_layers=int(self.field(f"{a}.block_count")),
            num_heads=int(heads),
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=RopeScaling(),
            partial_rotary_factor=rotary / head_dim,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in self.tensors,
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def hf_tensor(self, config: ModelConfig) -> Callable[[str], np.ndarray]:
        """A getter of Hugging Face-named fp32 tensors, dequantizing each one as it is asked for."""
        from gguf.quants import dequantize

        by_hf = {_gguf_to_hf_name(n, self.arch): t for n, t in self.tensors.items()}

        def get(name):
            t = by_hf.get(name)
            if t is None:
                raise UserError(f"{self.path} lacks the tensor for {name}")
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                w = unpermute_rope_rows(w, config.num_heads if "q_proj" in name else config.num_kv_heads)
            return w

        return get


def load_gguf(path: str, dtype=jnp.float32) -> tuple[ModelConfig, dict, GGUFFile]:
    gf = GGUFFile(path)
    config = gf.config()
    return config, from_hf_tensors(gf.hf_tensor(config), config, dtype), gf
