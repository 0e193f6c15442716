"""Model shape as a frozen, hashable dataclass: passed to jit as a static argument."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from s3djax.errors import UserError

ARCHITECTURES = ("llama", "phi3")
ATTENTION_IMPLS = ("xla", "pallas")


def default_attention() -> str:
    """Decode-time attention where none is asked for: the Pallas tree-attention kernel on a GPU, where it compiles
    natively (one launch a layer and no loop to leave the CUDA graph; it beat XLA's attention in 23 of 24 shapes on
    an H100, docs/gpu.md), XLA's elsewhere (the kernel only interprets there)."""
    import jax

    return "pallas" if jax.default_backend() == "gpu" else "xla"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Hugging Face `rope_parameters` beyond theta; `kind` is their `rope_type`."""

    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention: str = "xla"
    cpu_kernel: bool = True  # on the CPU, products and decode-time attention through the native kernels (cpu_kernels)

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise UserError(f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.attention not in ATTENTION_IMPLS:
            raise UserError(f"unknown attention implementation {self.attention!r}; choose from {', '.join(ATTENTION_IMPLS)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling.kind not in ("default", "linear", "llama3"):
            raise UserError(f"RoPE type {self.rope_scaling.kind!r} is not supported (default, linear, llama3 are)")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies, computed as Hugging Face does (fp32), including llama3 scaling."""
        dim = self.rotary_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        s = self.rope_scaling
        if s.kind == "linear":
            inv_freq = inv_freq / s.factor
        elif s.kind == "llama3":
            low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = np.where(medium, smoothed, scaled)
        return inv_freq.astype(np.float32)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face `config.json` dict (transformers 4 or 5 spelling of the RoPE fields)."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        if "Phi3ForCausalLM" in archs or model_type == "phi3":
            arch = "phi3"
        elif "LlamaForCausalLM" in archs or model_type == "llama":
            arch = "llama"
        else:
            raise UserError(f"unsupported checkpoint: architectures={archs} model_type={model_type!r}; "
                            "s3djax loads LlamaForCausalLM and Phi3ForCausalLM")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise UserError(f"checkpoint sets {flag}=true, which s3djax does not support")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        kind = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        # Fields a RoPE type does not read keep their defaults, so equal models give equal
        # (hash-equal) static configs and share compiled code.
        scaling = RopeScaling(kind=kind) if kind == "default" else RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            **({} if kind != "llama3" else dict(
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))))),
        )
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face config dict that builds the same model in transformers (parity tests, peers)."""
        s = self.rope_scaling
        rope = {"rope_type": s.kind, "rope_theta": self.rope_theta}
        if s.kind != "default":
            rope.update(factor=s.factor)
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        return dict(
            architectures=["Phi3ForCausalLM" if self.arch == "phi3" else "LlamaForCausalLM"],
            model_type=self.arch,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_parameters=rope,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) or None,
            pad_token_id=None,  # else Phi3Config defaults to 32000, outside small vocabularies
            hidden_act="silu",
        )
