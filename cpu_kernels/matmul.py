"""The CPU decode matmul: x [M, K] times a float32, bfloat16 or int8 weight, reading the weight once for
all M rows (`ffi.cc`, the kernels in `kernels.inc`), beside its jnp reference.

Decode-shaped products (M from 1 to a few dozen rows) are bound by reading the weight, so M rows should
cost about what one does; XLA:CPU runs M > 1 through GEMM paths that cost 2x or more. Each output
element is one fixed sequence of fused multiply-adds over K, whatever M is, so a row of a verify step's
product is bit-identical to the same row decoded alone.

The weight's layout is one of LAYOUTS: "kn" [K, N] (a linear as the model holds it), "nk" [N, K] (an
embedding table used as the LM head), or "panels": a linear packed once by `pack` into panels of P
columns (`panel()`, the vector unit's), each panel's K rows one after another, so that a panel is one
sequential stream where a plain [K, N] weight's column tiles are strided reads; or "pairs", bfloat16 panels
whose K rows come two at a time, a column's two values side by side, so one load holds two rows' weights (and
where the vector unit multiplies bfloat16 pairs, `pair_dot()`, and x is bfloat16, one instruction may add both
products: the blocking's `pair_dot`, measured); or "quads", int8 panels whose K rows come four at a time, for W8A8
(`int8_reference`): x quantized to int8 in blocks of QUANT_BLOCK, each block an exact integer dot product (one
instruction for 64 products where the vector unit has VNNI, `int8_dot()`). Packed weights keep the
shape [K, N] (the model's modules check their params' shapes); only the order of their elements changes. int8 weights
bring one fp32 scale per output column. Products accumulate and come out in fp32.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import batching
from cpu_kernels.build import LIBRARY

TARGET = "s3djax_matmul"
ATTENTION_TARGET = "s3djax_attention"  # cpu_kernels.attention's, in the same library
SWITCH = "S3DJAX_CPU_KERNEL"   # "0" turns the kernel off: every product goes through XLA's dot
WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


LAYOUTS = ("kn", "nk", "panels", "pairs", "quads")
PACKED_ROWS = {"panels": 1, "pairs": 2, "quads": 4}  # K rows a packed column holds side by side
QUANT_BLOCK = 32  # W8A8: x is quantized in blocks of this many K, one scale a block (llama.cpp's Q8_0 blocks)


def pack(w, panel: int, rows: int = 1):
    """A [K, N] weight's elements in panel order (N a multiple of panel), still shaped [K, N]: [N / P, K / s, P, s],
    each panel's rows s = `rows` at a time (K a multiple of s), a column's s values side by side."""
    k, n = w.shape
    return w.reshape(k // rows, rows, n // panel, panel).transpose(2, 0, 3, 1).reshape(k, n)


def unpack(w, panel: int, rows: int = 1):
    """`pack` undone."""
    k, n = w.shape
    return w.reshape(n // panel, k // rows, panel, rows).transpose(1, 3, 0, 2).reshape(k, n)


def packed_layout(dtype, k: int, a8: bool = False) -> str:
    """How a weight of `dtype` over K inputs is packed: in quads of rows for W8A8 (int8, K a multiple of QUANT_BLOCK),
    in pairs for bfloat16 (K even), else one row at a time."""
    if a8 and dtype == jnp.int8 and k % QUANT_BLOCK == 0:
        return "quads"
    return "pairs" if dtype == jnp.bfloat16 and k % 2 == 0 else "panels"


def quantize_rows(x):
    """x [..., K] (K a multiple of QUANT_BLOCK) as int8 blocks [..., K / QUANT_BLOCK, QUANT_BLOCK] and one fp32
    scale a block: d = max |x| * (1 / 127), values x * (1 / d) rounded to the nearest integer, ties to even (zero where the
    block is, or is not finite). The kernel quantizes to the same values (ffi.cc's QuantizeRows)."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, QUANT_BLOCK)
    d = jnp.max(jnp.abs(blocks), axis=-1) * (1 / 127)  # XLA makes a division by 127 this product anyway
    inverse = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
    q = jnp.round(blocks * inverse[..., None])
    return jnp.where(jnp.isfinite(q), jnp.clip(q, -127, 127), 0).astype(jnp.int8), d


def int8_reference(x, w, scale, nk: bool = False):
    """W8A8: x [..., K] quantized (`quantize_rows`, K padded with zeros to a multiple of QUANT_BLOCK) times the int8
    w [K, N] (or [N, K] with `nk`), each block's integer dot product times its scale, summed, times scale [N]."""
    k = x.shape[-1]
    pad = -k % QUANT_BLOCK
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        w = jnp.pad(w, [(0, 0), (0, pad)] if nk else [(0, pad), (0, 0)])
    q, d = quantize_rows(x)
    blocks = (k + pad) // QUANT_BLOCK
    w = w.reshape((w.shape[0], blocks, QUANT_BLOCK) if nk else (blocks, QUANT_BLOCK, w.shape[1]))
    # In fp32, exactly: a block's products and their sum are integers below 2^24. The blocks are summed by a product
    # too: as a reduction XLA:CPU (jax 0.10.2) made it a YNNPACK fusion, which gave NaN where two met in one program.
    sums = jnp.einsum("...bk,nbk->...bn" if nk else "...bk,bkn->...bn", q.astype(jnp.float32),
                      w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("...bn,...b->...n", sums, d, precision=jax.lax.Precision.HIGHEST) * scale


def reference(x, w, scale=None, layout: str = "kn"):
    """x [..., K] @ w in `layout`, times scale [N] if given, in fp32: [..., N]. "quads" is W8A8 (`int8_reference`)."""
    w = unpack(w, panel(), PACKED_ROWS[layout]) if layout in PACKED_ROWS else w
    if layout == "quads":
        return int8_reference(x, w, scale)
    out = jnp.einsum("...k,nk->...n" if layout == "nk" else "...k,kn->...n", x.astype(jnp.float32),
                     w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out if scale is None else out * scale


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run in this process, or None once their handlers are registered with XLA."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"turned off by {SWITCH}=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"no kernel for {platform.machine()}"
    if not LIBRARY.exists():
        return f"{LIBRARY} is not built (make setup, or python -m cpu_kernels.build)"
    try:
        lib = _library()
    except (OSError, AttributeError) as e:
        return f"cannot load {LIBRARY}: {e}"
    if lib.s3d_cpu_isa() is None:
        return "this CPU has neither AVX2 with FMA nor AVX-512"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.S3dMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.S3dAttention), platform="cpu")
    return None


@functools.cache
def isa() -> str | None:
    """The vector unit the kernel runs on ("avx512-bf16", "avx512", "avx2"), or None where it is unavailable."""
    return None if unavailable() else _library().s3d_cpu_isa().decode()


@functools.cache
def panel() -> int:
    """Columns per packed panel on this CPU's vector unit (0 where the kernel is unavailable)."""
    return 0 if unavailable() else _library().s3d_cpu_panel()


@functools.cache
def pair_dot() -> bool:
    """Whether this CPU's vector unit multiplies bfloat16 pairs in one instruction (AVX-512 BF16), which the blocking's
    `pair_dot` may then take."""
    return not unavailable() and bool(_library().s3d_cpu_pair_dot())


@functools.cache
def int8_dot() -> bool:
    """Whether this CPU's vector unit sums int8 quads in one instruction (AVX-512 VNNI), which W8A8's products take;
    elsewhere they run on fused multiply-adds, to the same bits."""
    return not unavailable() and bool(_library().s3d_cpu_int8_dot())


@functools.cache
def _library():
    lib = ctypes.cdll.LoadLibrary(str(LIBRARY))
    lib.s3d_cpu_isa.restype = ctypes.c_char_p
    lib.s3d_cpu_panel.restype = ctypes.c_int64
    lib.s3d_cpu_pair_dot.restype = ctypes.c_int
    lib.s3d_cpu_int8_dot.restype = ctypes.c_int
    lib.s3d_cpu_set_blocking.argtypes = [ctypes.c_int64] * len(BLOCKING)
    lib.s3d_cpu_blocking.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.s3d_cpu_blocking.restype = None
    lib.s3d_cpu_time_products.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int32]
    lib.s3d_cpu_time_products.restype = ctypes.c_double
    return lib


# How the kernel's loops are blocked (cpu_kernels/matmul.h's Blocking): none of it changes a result.
BLOCKING = ("prefetch", "chunk_bytes", "tile_rows", "pair_dot", "row_panels")


def set_blocking(blocking: dict) -> None:
    """Every later product takes `blocking` ({name: int} over BLOCKING)."""
    if unavailable():
        raise RuntimeError(f"the CPU matmul cannot run here: {unavailable()}")
    if _library().s3d_cpu_set_blocking(*(int(blocking[k]) for k in BLOCKING)):
        raise ValueError(f"the CPU matmul takes no blocking {blocking}")


def blocking() -> dict | None:
    """The blocking products take now, or None where no product takes it: the kernel is unavailable, or the backend
    is not the CPU (what a step's times depend on, s3djax.defaults)."""
    if unavailable() or jax.default_backend() != "cpu":
        return None
    out = (ctypes.c_int64 * len(BLOCKING))()
    _library().s3d_cpu_blocking(out)
    return dict(zip(BLOCKING, out))


def time_products(w: np.ndarray, m: int, k: int, n: int, repeats: int, bf16: bool = False) -> float:
    """Milliseconds for the fastest of `repeats` passes of M-row products over the buffer `w`, read as packed [k, n]
    panels one after another (as a decode step reads its layers), under the blocking set now: fp32 panels, or with
    `bf16` bfloat16 panels in pairs of rows (its bytes, whatever its dtype) times bfloat16 x."""
    if unavailable():
        raise RuntimeError(f"the CPU matmul cannot run here: {unavailable()}")
    w = np.ascontiguousarray(w)
    ms = _library().s3d_cpu_time_products(w.ctypes.data, w.nbytes, m, k, n, repeats, int(bf16))
    if ms < 0:
        raise ValueError(f"cannot time {m}-row products of [{k}, {n}] panels over {w.nbytes} bytes")
    return ms


@functools.cache
def usable() -> bool:
    """Whether products on the CPU go through the kernel; says once on stderr why not, where it was wanted."""
    reason = unavailable()
    if reason and not reason.startswith("turned off") and jax.default_backend() == "cpu":
        print(f"s3djax: the CPU matmul kernel is unavailable ({reason}); using XLA's dot", file=sys.stderr)
    return reason is None


def _call(x, w, scale, layout: str):
    *lead, k = x.shape
    n = w.shape[0] if layout == "nk" else w.shape[1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    def call(x2, w, scale):
        return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
            x2, w, scale, layout=np.int32(LAYOUTS.index(layout)), x_bf16=np.int32(x.dtype == jnp.bfloat16))
    out = batching.folded(call, (True, False, False))(x2, w, scale)
    return out.reshape(*lead, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def matmul(x, w, scale=None, layout: str = "kn"):
    """`reference`'s product through the kernel (the CPU only: register it first, see `usable`).
    Differentiable: the derivative is the reference's, through XLA."""
    if unavailable():
        raise RuntimeError(f"the CPU matmul cannot run here: {unavailable()}")
    if w.dtype not in WEIGHT_DTYPES or w.ndim != 2 or x.shape[-1] != w.shape[layout == "nk"] or (
            layout in PACKED_ROWS and w.shape[1] % panel()) or (
            layout == "pairs" and (w.dtype != jnp.bfloat16 or w.shape[0] % 2)) or (
            layout == "quads" and (w.dtype != jnp.int8 or w.shape[0] % QUANT_BLOCK or scale is None)):
        raise ValueError(f"the CPU matmul takes x [..., K] and a float32, bfloat16 or int8 weight in layout "
                         f"{layout!r} (pairs: bfloat16, K even; quads: int8 with its scales, K a multiple of "
                         f"{QUANT_BLOCK}); got x {x.shape} and {w.dtype.name} {w.shape}")
    return _call(x, w, scale, layout)


@matmul.defjvp
def _matmul_jvp(layout, primals, tangents):
    out = matmul(*primals, layout)
    _, tangent = jax.jvp(functools.partial(reference, layout=layout), primals, tangents)
    return out, tangent
