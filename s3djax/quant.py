"""int8 weights: symmetric int8 values with one fp32 scale per output channel; weight-only (W8A16: "int8" for the
layers' linears, "int8-all" for the embedding and LM head too), or with int8 activations too ("w8a8": every product's
input quantized in blocks of 32, as llama.cpp's Q8_0 is, each block an exact integer dot product;
`cpu_kernels.matmul.int8_reference`).

A quantized weight is an `Int8Weight` node in the ordinary params pytree, and the model reads every
weight through `dot`, `take` and `head`, so float and quantized params share one forward. Linears
[in, out] keep a scale per column. The embedding and LM-head tables [V, D] keep one per row, which
is both the lookup's row and the head's output channel.

Weight-only, activations stay in the model's dtype: on GPU the convert fuses into the dot, so decode reads one
byte per weight instead of two or four. W8A8 does the arithmetic of several rows in integers: on a CPU with VNNI one
instruction makes 64 products, so a verify step's rows cost little more than one row's weights (docs/kernels.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import jax
import jax.numpy as jnp

from s3djax.errors import UserError

MODES = ("none", "int8", "int8-all", "w8a8")
KERNELS = ("xla", "pallas")
LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")
TABLES = ("embed", "lm_head")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"],
                   meta_fields=["axis", "dtype", "kernel", "a8"])
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    values: jax.Array  # int8, the float weight's shape
    scale: jax.Array   # fp32, one per output channel
    axis: int = 1      # the output-channel axis of `values`: 1 for linears, 0 for tables
    dtype: str = "float32"  # the activations' dtype, which products come out in
    kernel: str = "xla"     # how `dot` multiplies: XLA's fused convert, or the Pallas kernel
    a8: bool = False        # W8A8: the activations multiplied are quantized to int8 too

    @property
    def shape(self):
        return self.values.shape

    @property
    def T(self) -> "Int8Weight":
        """The 2-D transpose, scales unchanged ([out, in] checkpoints to our [in, out])."""
        return dataclasses.replace(self, values=self.values.T, axis=1 - self.axis)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scale"],
                   meta_fields=["dtype", "panel", "table", "rows"])
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight laid out once for the CPU kernel (`cpu_kernels.matmul.pack`): a linear [K, N], or a table
    [N, K] (the embedding and LM head) packed from its transpose; float, or int8 with its per-output scale.

    Made by `pack_for_cpu` where the kernel runs, and nowhere else. `values` keeps the source's shape,
    which the model's modules check; only the order of its elements changes.
    """
    values: jax.Array
    scale: jax.Array | None
    dtype: str = "float32"  # the activations' dtype, which products come out in
    panel: int = 64         # columns of the [K, N] product per panel
    table: bool = False
    rows: int = 1           # K rows a column holds side by side (cpu_kernels.matmul's PACKED_ROWS, `packed_layout`):
                            # 2, bfloat16 pairs; 4, W8A8's int8 quads

    @property
    def layout(self) -> str:
        from cpu_kernels.matmul import PACKED_ROWS

        return next(name for name, rows in PACKED_ROWS.items() if rows == self.rows)

    @property
    def a8(self) -> bool:
        return self.rows == 4

    @property
    def shape(self):
        return self.values.shape

    def kn(self):
        """The [K, N] matrix of panels the kernel reads (a free reshape)."""
        return self.values.reshape(self.values.shape[::-1]) if self.table else self.values

    def unpacked(self):
        """The source weight, a plain array or an `Int8Weight`: what XLA's paths read."""
        from cpu_kernels.matmul import unpack

        w = unpack(self.kn(), self.panel, self.rows)
        w = w.T if self.table else w
        return w if self.scale is None else Int8Weight(w, self.scale, 0 if self.table else 1, self.dtype, a8=self.a8)

    def table_rows(self, ids):
        """Rows of a packed table, gathered from its panels without unpacking the rest."""
        n, k = self.values.shape
        s = self.rows  # `pack`'s [N / P, K / s, P, s]
        values = self.values.reshape(n // self.panel, k // s, self.panel, s)[ids // self.panel, :, ids % self.panel]
        values = values.reshape(*values.shape[:-2], k)
        return values if self.scale is None else Int8Weight(values, self.scale[ids], 0, self.dtype, a8=self.a8)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Transposed:
    """A float linear [in, out] held as its transpose [out, in], for a GPU (`lay_out_for_gpu`).

    A one-row product over [in, out] is a column reduction, which XLA's GPU compiler writes out as a
    product buffer three times the weight's size plus a second kernel; over [out, in] it is one row
    reduction reading the weight once (docs/gpu-compile.md). `values` keeps the source's shape, which the
    model's modules check; only the order of its elements changes.
    """
    values: jax.Array

    @property
    def shape(self):
        return self.values.shape

    def nk(self):
        """The [out, in] matrix (a free reshape)."""
        return self.values.reshape(self.values.shape[::-1])

    def unpacked(self):
        return self.nk().T


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
    if isinstance(w, (Packed, Transposed)):
        return dequantize(w.unpacked())
    if not isinstance(w, Int8Weight):
        return w
    scale = w.scale[:, None] if w.axis == 0 else w.scale[None, :]
    return (w.values.astype(jnp.float32) * scale).astype(w.dtype)


def _convert(w, channel_axis: int, mode: str, dtype, kernel: str):
    if mode == "none":
        return jnp.asarray(dequantize(w), dtype)
    if not isinstance(w, Int8Weight):
        w = quantize(w, channel_axis)
    if w.axis != channel_axis:
        raise ValueError(f"an int8 weight quantized along axis {w.axis} where axis {channel_axis} was expected")
    return Int8Weight(jnp.asarray(w.values), jnp.asarray(w.scale, jnp.float32), w.axis, jnp.dtype(dtype).name, kernel,
                      mode == "w8a8")


def linear(w, mode: str, dtype, kernel: str = "xla"):
    """A layer's [in, out] weight, float or Int8Weight, as `mode` asks (converting either way)."""
    return _convert(w, 1, "int8" if mode == "int8-all" else mode, dtype, kernel)


def table(w, mode: str, dtype, kernel: str = "xla"):
    """The embedding or LM head [V, D]: int8 only under int8-all and w8a8."""
    return _convert(w, 0, {"int8-all": "int8", "w8a8": "w8a8"}.get(mode, "none"), dtype, kernel)


def check_mode(mode: str, kernel: str = "xla") -> None:
    if mode not in MODES:
        raise UserError(f"unknown quantization {mode!r}; choose from {', '.join(MODES)}")
    if kernel not in KERNELS:
        raise UserError(f"unknown int8 matmul {kernel!r}; choose from {', '.join(KERNELS)}")
    if mode == "w8a8" and kernel != "xla":
        raise UserError(f"--quant w8a8 multiplies in integers through XLA or the CPU kernel, not the {kernel} int8 "
                        "matmul; leave --matmul at xla")


def apply(params: dict, mode: str, dtype, kernel: str = "xla") -> dict:
    """Params converted to `mode`, by each weight's name; weights already in that form pass through unchanged."""
    check_mode(mode, kernel)

    def convert(path, w):
        name = path[-1].key
        if isinstance(w, (Packed, Transposed)):
            return w
        if name in LINEARS:
            return linear(w, mode, dtype, kernel)
        return table(w, mode, dtype, kernel) if name in TABLES and len(path) == 1 else w

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_weight)


def is_int8(x) -> bool:
    return isinstance(x, Int8Weight) or (isinstance(x, Packed) and x.values.dtype == jnp.int8)


def is_a8(x) -> bool:
    """An int8 weight whose products quantize their activations too (W8A8)."""
    return isinstance(x, (Int8Weight, Packed)) and x.a8


def is_weight(x) -> bool:
    """A weight node that tree maps must treat whole: an int8 or a packed weight."""
    return isinstance(x, (Int8Weight, Packed, Transposed))


def dequantize_tree(tree):
    """Every int8 weight in `tree` as float, the rest as it is."""
    return jax.tree.map(dequantize, tree, is_leaf=is_weight)


def compiler_options(params) -> dict:
    """XLA options for compiling a step over `params`, wherever one is compiled (`decode.Runner`, step
    timing, `benchmarks.h100_compile`): with int8 weights multiplied by XLA's dot, no dot merging on a GPU.

    XLA's DotMerger joins the products that share an input (q/k/v, gate/up) into one GEMM over the
    concatenated weights, and that GEMM cannot fuse the int8 -> bf16 converts: each weight is converted into
    a bf16 buffer of its own. Where a draft and its verification read the same layers in one loop body, CSE
    shares those buffers, so they stay live from the draft to the verification: 2.6 GiB more temp than AR at
    Llama-2-7B's shape (S3D, gamma 4), 70 MiB of copies at SmolLM2's (docs/gpu-compile.md). Unmerged, each
    product converts inside its own GEMM (a GPU may tile it otherwise); other platforms ignore the option.
    """
    leaves = jax.tree.leaves(params, is_leaf=is_weight)
    if any(isinstance(w, Int8Weight) and w.kernel == "xla" for w in leaves):
        return {"xla_gpu_dot_merger_threshold_mb": 0}
    return {}


def mode_of(params: dict) -> str:
    layer = jax.tree.leaves(params["layers_0"], is_leaf=is_weight)
    if not any(is_int8(w) for w in layer):
        return "none"
    if any(is_a8(w) for w in layer):
        return "w8a8"
    return "int8-all" if is_int8(params["embed"]) else "int8"


def param_bytes(params) -> int:
    """Bytes of distinct arrays: a draft that reuses the target's own layers (S2D) adds nothing for them."""
    return sum({id(leaf): leaf.nbytes for leaf in jax.tree.leaves(params)}.values())


# ------------------------------------------------------------------------------ the forward's reads

def dot(h, w, cpu_kernel: bool = False):
    """h [..., in] @ w [in, out], for a float or int8 w; the result is in h's dtype.

    `cpu_kernel`: on the CPU, through the native decode matmul (`cpu_kernels.matmul`) where it can run;
    lowered for any other platform, the code is XLA's as without it.
    """
    if _use_cpu_kernel(cpu_kernel or isinstance(w, Packed), h) and _kernel_takes(w):
        return _kernel_dot(h, w)
    return _xla_dot(h, w)


def _kernel_takes(w) -> bool:
    """Whether the CPU kernel multiplies by w: W8A8's only as int8 quads (`pack_for_cpu`, K a multiple of 32)."""
    return not isinstance(w, Int8Weight) or not w.a8


# Jitted so that a model's many products of one shape are traced once, not once per layer: tracing both
# branches of every product was half of tracing a SmolLM2 decode loop. XLA inlines the calls.
@jax.jit
def _kernel_dot(h, w):
    return jax.lax.platform_dependent(h, w, cpu=functools.partial(_cpu_kernel, layout="kn"), default=_xla_dot)


def _xla_dot(h, w):
    if isinstance(w, Transposed):
        return jnp.einsum("...k,nk->...n", h, w.nk())
    if isinstance(w, Packed):
        w = w.unpacked()
    if not isinstance(w, Int8Weight):
        return h @ w
    if w.a8:
        from cpu_kernels.matmul import int8_reference

        return int8_reference(h, w.values, w.scale).astype(h.dtype)
    if w.kernel == "pallas":
        from pallas_kernels.int8_matmul import int8_matmul

        return int8_matmul(h, w.values, w.scale)
    out = jnp.einsum("...k,kn->...n", h, w.values.astype(h.dtype), preferred_element_type=jnp.float32)
    return (out * w.scale).astype(h.dtype)


def take(table_, tokens):
    """Embedding rows for token ids."""
    picked = table_.table_rows(tokens) if isinstance(table_, Packed) else rows(table_, tokens)
    if not isinstance(picked, Int8Weight):
        return picked
    return (picked.values.astype(jnp.float32) * picked.scale[..., None]).astype(picked.dtype)


def rows(table_, ids):
    """Some rows of an embedding or head table [V, D], float or int8, as a table of their own."""
    if isinstance(table_, Packed):
        return table_.table_rows(ids)
    if not isinstance(table_, Int8Weight):
        return table_[ids]
    return dataclasses.replace(table_, values=table_.values[ids], scale=table_.scale[ids])


def head(hidden, table_, cpu_kernel: bool = False):
    """fp32 logits hidden [..., D] x table [V, D]^T (the tied or untied LM head); `cpu_kernel` as for `dot`."""
    if _use_cpu_kernel(cpu_kernel or isinstance(table_, Packed), hidden) and _kernel_takes(table_):
        return _kernel_head(hidden, table_)
    return _xla_head(hidden, table_)


@jax.jit  # as `_kernel_dot`
def _kernel_head(hidden, table_):
    return jax.lax.platform_dependent(hidden, table_, cpu=functools.partial(_cpu_kernel, layout="nk", out=jnp.float32),
                                      default=_xla_head)


def _xla_head(hidden, table_):
    if isinstance(table_, Packed):
        table_ = table_.unpacked()
    if not isinstance(table_, Int8Weight):
        return jnp.einsum("...d,vd->...v", hidden, table_, preferred_element_type=jnp.float32)
    if table_.a8:
        from cpu_kernels.matmul import int8_reference

        return int8_reference(hidden, table_.values, table_.scale, nk=True)
    out = jnp.einsum("...d,vd->...v", hidden, table_.values.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return out * table_.scale


# Beyond this many rows (a long prompt's prefill, a training batch) a product is a GEMM, which XLA's dot runs
# well; every decode-time step (drafts, trees, verification, any batch) stays under it, so its rows all
# take the kernel's one order of summation.
CPU_KERNEL_MAX_ROWS = 4096


def _use_cpu_kernel(wanted: bool, h) -> bool:
    return wanted and math.prod(h.shape[:-1]) <= CPU_KERNEL_MAX_ROWS and cpu_kernels_usable()


def cpu_kernels_usable() -> bool:
    """Whether the native CPU kernels (`cpu_kernels`: the matmul and decode attention) run in this process."""
    from cpu_kernels import matmul

    return matmul.usable()


def _cpu_kernel(h, w, *, layout: str, out=None):
    from cpu_kernels import matmul

    if isinstance(w, Packed):
        values, scale, layout = w.kn(), w.scale, w.layout
    else:
        values, scale = (w.values, w.scale) if isinstance(w, Int8Weight) else (w, None)
    return matmul.matmul(h, values, scale, layout).astype(out or h.dtype)


def pack_for_cpu(params):
    """`params` with its linears and tables (the embedding, LM head and draft-vocabulary heads) as `Packed`
    weights where the CPU kernel runs (else unchanged), those whose panels divide their width; a Llama layer's q, k
    and v, and gate and up, joined first (`JOINED`): one call of the kernel instead of three or two, each costing
    microseconds of its own, and every output column the same fma chain as apart. A weight met twice (a draft
    sharing the target's layers) is packed once, and one packed by an earlier call is reused while its source
    lives."""
    from cpu_kernels import matmul

    if jax.default_backend() != "cpu" or not matmul.usable():
        return params
    from s3djax import kernel_tuning

    kernel_tuning.ensure()
    panel = matmul.panel()
    params = _map_dicts(params, lambda tree: _joined(tree, _join_for_cpu))

    def convert(path, w):
        name = path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else None
        table = name in TABLES or name == "head"
        if not (name in LINEARS or table) or isinstance(w, Packed):
            return w
        values, scale, dtype = (w.values, w.scale, w.dtype) if isinstance(w, Int8Weight) else (w, None, w.dtype.name)
        if values.ndim != 2 or values.shape[0 if table else 1] % panel or (
                isinstance(w, Int8Weight) and (w.axis, w.kernel) != (0 if table else 1, "xla")):
            return w
        layout = matmul.packed_layout(values.dtype, values.shape[1 if table else 0], is_a8(w))
        if is_a8(w) and layout != "quads":
            return w  # W8A8 over a K the kernel's quads cannot take: XLA's integer dot
        rows = matmul.PACKED_ROWS[layout]
        return _made_once("packed", [values], lambda: Packed(_pack(values, panel, table, rows), scale, dtype, panel,
                                                             table, rows))

    return jax.tree_util.tree_map_with_path(convert, params, is_leaf=is_weight)


_MADE: dict[tuple, tuple] = {}


def _made_once(kind: str, sources: list, make):
    """make(), kept while every array of `sources` lives and given again for the same arrays (a weight is packed or
    joined once, however many models hold it); made anew under a trace."""
    if any(isinstance(s, jax.core.Tracer) for s in sources):
        return make()
    key = (kind, *map(id, sources))
    hit = _MADE.get(key)
    if hit is None or any(ref() is not s for ref, s in zip(hit[0], sources)):
        hit = ([weakref.ref(s) for s in sources], make())
        _MADE[key] = hit
        for s in sources:
            weakref.finalize(s, _MADE.pop, key, None)
    return hit[1]


# A Llama layer's products that read one input, joined on a GPU as Phi-3 ships them: one product reads the norm's
# output (at SmolLM2's shape XLA merges gate and up itself; at the 7B shape they were two GEMMs, a launch each).
JOINED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def lay_out_for_gpu(params):
    """`params` with its float linears as `Transposed` (tables are [V, D] already) and a Llama layer's q, k and v, and
    gate and up, joined (`JOINED`), for the GPU backend whatever the process's default (`benchmarks.h100_compile`
    compiles for one on a CPU). One product then reads the attention norm's output, and XLA fuses the norm into it
    instead of writing the normed vector for three (docs/gpu-compile.md). A weight met twice
    (a draft sharing the target's layers) is laid out once; int8 weights are left as they are."""
    done = {}

    def transposed(ws):  # the products of ws joined along their outputs, as one [out, in] weight, made once
        key = tuple(map(id, ws))
        if key not in done:
            done[key] = (ws, Transposed(_transposed(*ws)))  # ws kept alive, so their ids stay theirs
        return done[key][1]

    def layer(tree):
        tree = _joined(tree, lambda ws: transposed(ws) if all(map(_plain, ws)) else None)
        return {n: transposed([w]) if n in LINEARS and _plain(w) else w for n, w in tree.items()}

    return _map_dicts(params, layer)


def _plain(w) -> bool:
    """A float matrix as loaded: not int8, packed or laid out."""
    return not is_weight(w) and getattr(w, "ndim", 0) == 2


def _map_dicts(tree, fn):
    """`tree` with fn applied to each of its dicts (a layer's weights, a model's), innermost first, through the lists
    and (target, draft) pairs that hold them."""
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_map_dicts(x, fn) for x in tree)
    if not isinstance(tree, dict):
        return tree
    return fn({k: _map_dicts(v, fn) for k, v in tree.items()})


def _joined(tree: dict, join) -> dict:
    """A dict of weights with each group of `JOINED` it holds as one weight, join(parts), where join makes one."""
    for name, parts in JOINED.items():
        if all(n in tree for n in parts) and (w := join([tree[n] for n in parts])) is not None:
            tree = {**{k: v for k, v in tree.items() if k not in parts}, name: w}
    return tree


def _join_for_cpu(ws):
    """Linears [in, out] that read one input, as one [in, sum of outs]: float ones of one dtype, or int8 ones (XLA's,
    scales per column) of one activation dtype; else None. Made once while its parts live."""
    if all(map(_plain, ws)) and len({w.dtype for w in ws}) == 1:
        values, scales = list(ws), None
    elif all(isinstance(w, Int8Weight) and (w.axis, w.kernel, w.dtype, w.a8) == (1, "xla", ws[0].dtype, ws[0].a8)
             for w in ws):
        values, scales = [w.values for w in ws], [w.scale for w in ws]
    else:
        return None

    def join():
        v = jnp.concatenate(values, axis=1)
        return v if scales is None else Int8Weight(v, jnp.concatenate(scales), 1, ws[0].dtype, a8=ws[0].a8)
    return _made_once("joined", values, join)


@jax.jit
def _transposed(*ws):
    nk = jnp.concatenate([w.T for w in ws], axis=0)
    return nk.reshape(nk.shape[::-1])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _pack(values, panel: int, table: bool, rows: int):
    from cpu_kernels.matmul import pack

    return pack(values.T, panel, rows).reshape(values.shape) if table else pack(values, panel, rows)
