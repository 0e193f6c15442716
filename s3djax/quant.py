"""Weight-only int8 (W8A16): symmetric int8 values with one fp32 scale per output channel.

A quantized weight is an `Int8Weight` node in the ordinary params pytree, and the model reads every
weight through `dot`, `take` and `head`, so float and quantized params share one forward. Linears
[in, out] keep a scale per column. The embedding and LM-head tables [V, D] keep one per row, which
is both the lookup's row and the head's output channel.

Activations stay in the model's dtype: on GPU the convert fuses into the dot, so decode reads one
byte per weight instead of two or four.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from s3djax.errors import UserError

MODES = ("none", "int8", "int8-all")
KERNELS = ("xla", "pallas")
LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")
TABLES = ("embed", "lm_head")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"],
                   meta_fields=["axis", "dtype", "kernel"])
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    values: jax.Array  # int8, the float weight's shape
    scale: jax.Array   # fp32, one per output channel
    axis: int = 1      # the output-channel axis of `values`: 1 for linears, 0 for tables
    dtype: str = "float32"  # the activations' dtype, which products come out in
    kernel: str = "xla"     # how `dot` multiplies: XLA's fused convert, or the Pallas kernel

    @property
    def shape(self):
        return self.values.shape

    @property
    def T(self) -> "Int8Weight":
        """The 2-D transpose, scales unchanged ([out, in] checkpoints to our [in, out])."""
        return dataclasses.replace(self, values=self.values.T, axis=1 - self.axis)


def quantize(w, channel_axis: int) -> Int8Weight:
    """Round to the nearest of 255 levels symmetric about zero, per channel (an all-zero channel gets scale 1).

    Runs where `w` lives: on the accelerator for a 7B model's weights, never through host memory.
    """
    values, scale = _quantize(jnp.asarray(w), channel_axis)
    return Int8Weight(values, scale, channel_axis)


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, channel_axis: int):
    w = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=1 - channel_axis, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return values, scale.reshape(-1)


def dequantize(w):
    if not isinstance(w, Int8Weight):
        return w
    scale = w.scale[:, None] if w.axis == 0 else w.scale[None, :]
    return (w.values.astype(jnp.float32) * scale).astype(w.dtype)


def _convert(w, channel_axis: int, quantized: bool, dtype, kernel: str):
    if not quantized:
        return jnp.asarray(dequantize(w), dtype)
    if not isinstance(w, Int8Weight):
        w = quantize(w, channel_axis)
    if w.axis != channel_axis:
        raise ValueError(f"an int8 weight quantized along axis {w.axis} where axis {channel_axis} was expected")
    return Int8Weight(jnp.asarray(w.values), jnp.asarray(w.scale, jnp.float32), w.axis, jnp.dtype(dtype).name, kernel)


def linear(w, mode: str, dtype, kernel: str = "xla"):
    """A layer's [in, out] weight, float or Int8Weight, as `mode` asks (converting either way)."""
    return _convert(w, 1, mode != "none", dtype, kernel)


def table(w, mode: str, dtype, kernel: str = "xla"):
    """The embedding or LM head [V, D]: int8 only under int8-all."""
    return _convert(w, 0, mode == "int8-all", dtype, kernel)


def check_mode(mode: str, kernel: str = "xla") -> None:
    if mode not in MODES:
        raise UserError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    if kernel not in KERNELS:
        raise UserError(f"unknown int8 matmul {kernel!r}; choose from {', '.join(KERNELS)}")


def apply(params: dict, mode: str, dtype, kernel: str = "xla") -> dict:
    """Params converted to `mode`, by each weight's name; weights already in that form pass through unchanged."""
    check_mode(mode, kernel)

    def convert(path, w):
        name = path[-1].key
        if name in LINEARS:
            return linear(w, mode, dtype, kernel)
        return table(w, mode, dtype, kernel) if name in TABLES and len(path) == 1 else w

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_int8)


def is_int8(x) -> bool:
    return isinstance(x, Int8Weight)


def dequantize_tree(tree):
    """Every int8 weight in `tree` as float, the rest as it is."""
    return jax.tree.map(dequantize, tree, is_leaf=is_int8)


def mode_of(params: dict) -> str:
    if not any(is_int8(w) for w in jax.tree.leaves(params["layers_0"], is_leaf=is_int8)):
        return "none"
    return "int8-all" if is_int8(params["embed"]) else "int8"


def param_bytes(params) -> int:
    """Bytes of distinct arrays: a draft that reuses the target's own layers (S2D) adds nothing for them."""
    return sum({id(leaf): leaf.nbytes for leaf in jax.tree.leaves(params)}.values())


# ------------------------------------------------------------------------------ the forward's reads

def dot(h, w):
    """h [..., in] @ w [in, out], for a float or int8 w; the result is in h's dtype."""
    if not isinstance(w, Int8Weight):
        return h @ w
    if w.kernel == "pallas":
        from pallas_kernels.int8_matmul import int8_matmul

        return int8_matmul(h, w.values, w.scale)
    out = jnp.einsum("...k,kn->...n", h, w.values.astype(h.dtype), preferred_element_type=jnp.float32)
    return (out * w.scale).astype(h.dtype)


def take(table_, tokens):
    """Embedding rows for token ids."""
    if not isinstance(table_, Int8Weight):
        return table_[tokens]
    return (table_.values[tokens].astype(jnp.float32) * table_.scale[tokens][..., None]).astype(table_.dtype)


def rows(table_, ids):
    """Some rows of an embedding or head table [V, D], float or int8, as a table of their own."""
    if not isinstance(table_, Int8Weight):
        return table_[ids]
    return dataclasses.replace(table_, values=table_.values[ids], scale=table_.scale[ids])


def head(hidden, table_):
    """fp32 logits hidden [..., D] x table [V, D]^T (the tied or untied LM head)."""
    if not isinstance(table_, Int8Weight):
        return jnp.einsum("...d,vd->...v", hidden, table_, preferred_element_type=jnp.float32)
    out = jnp.einsum("...d,vd->...v", hidden, table_.values.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return out * table_.scale
