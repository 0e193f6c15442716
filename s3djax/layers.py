"""The pieces of a decoder layer as Flax Linen modules: RMSNorm, rotary attention, SwiGLU MLP, Block.

Modules are used pure-functionally: the K/V cache goes in as an argument and comes out as a
result (no mutable collections), and LoRA adapters come in as an argument, so one jitted step
serves the target and every draft over the same params tree.

Weights are raw `self.param`s read through `quant.dot`, so any of them may be a `quant.Int8Weight`.
Linear weights are [in, out]; Llama attention holds q/k/v/o and its MLP gate/up/down, Phi-3 the fused
qkv and gate_up it ships with.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from s3djax import cache as kv
from s3djax import quant
from s3djax.cache import PrefixTreeMask, PromptMask
from s3djax.config import ModelConfig

# A large finite negative instead of -inf: a fully masked row (padding) then gives a uniform
# softmax instead of NaNs that would poison the cache through later layers.
MASKED = -1e30
dense_init = nn.initializers.normal(0.02)


class RMSNorm(nn.Module):
    """As Hugging Face's: normalized in fp32, cast back, then scaled. Given a `residual`, (x + residual, the norm of
    that). `pallas`: a step of one token a row does both in one Pallas kernel (`pallas_kernels.rms_norm`; no
    gradient): there XLA on a GPU left the reduction, the normalized vector and the add apart, where for several rows
    it fuses them with the GEMM's split-K sum before them (docs/gpu-compile.md)."""
    eps: float
    pallas: bool = False

    @nn.compact
    def __call__(self, x, residual=None):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if self.pallas and x.ndim == 3 and x.shape[1] == 1:
            from pallas_kernels.rms_norm import rms_norm

            return rms_norm(x, scale, residual, eps=self.eps)
        from pallas_kernels.rms_norm import reference

        return reference(x, scale, self.eps, residual)


def linear(module: nn.Module, name: str, shape: tuple[int, int], h, lora):
    """h @ W for the module's weight `name`, plus the low-rank update (h @ A) @ B where a draft adapter covers it,
    on the rows `lora["rows"]` [T] weighs by 1 where it has them (a draft's rows inside the verify pass)."""
    out = quant.dot(h, module.param(name, dense_init, shape), module.config.cpu_kernel)
    update = lora_update(h, lora, name, module.config.cpu_kernel)
    return out if update is None else out + update


def lora_update(h, lora, name: str, kernel: bool):
    """The low-rank update (h @ A) @ B of `name`'s adapter, on `lora["rows"]`'s rows where it has them; None
    where no adapter covers `name`."""
    if not (lora and name in lora):
        return None
    update = quant.dot(quant.dot(h, lora[name]["a"], kernel), lora[name]["b"], kernel)
    return update * lora["rows"][:, None].astype(update.dtype) if "rows" in lora else update


def rope_tables(positions, inv_freq):
    """cos/sin of shape [B, T, 1, rotary_dim] (broadcast over heads), in fp32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Hugging Face's rotate-half RoPE on the first rotary_dim features; the rest pass through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = (rot * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


KEY_BLOCK = 128  # keys per step of the occupied-prefix loop


def write_and_attend(q, k, v, layer_cache: dict, slots, mask, impl: str = "xla", cpu_kernel: bool = False):
    """Writes the new K/V [B, T, K, D] into the layer's cache from `slots` [B], then `attend`s q over it.

    The Pallas kernel (`impl="pallas"`, a decode step's square tree) does both in one launch: it takes the new
    keys apart from the cache anyway. Returns (out [B, T, H*D], layer_cache).
    """
    b, t, h, d = q.shape
    held = kv.float_dtype(layer_cache["k"])
    k, v = k.astype(held), v.astype(held)
    if (impl == "pallas" and _step(mask) and mask.tree.shape[1] == mask.tree.shape[2] and not _on_cpu_kernel(cpu_kernel)
            and q.dtype == layer_cache["k"].dtype == held):
        from pallas_kernels.tree_attention import tree_attention

        out, kc, vc = tree_attention(q, layer_cache["k"], layer_cache["v"], mask.lengths, k, v, mask.tree, slots)
        return out.reshape(b, t, h * d), {"k": kc, "v": vc}
    layer_cache = kv.write(layer_cache, k, v, slots)
    return attend(q, layer_cache["k"], layer_cache["v"], mask, cpu_kernel), layer_cache


def _step(mask) -> bool:
    """A decode-time step's mask (a prompt's chunk is not one)."""
    return isinstance(mask, PrefixTreeMask) and not isinstance(mask, PromptMask)


def _on_cpu_kernel(cpu_kernel: bool) -> bool:
    return cpu_kernel and quant.cpu_kernels_usable()


def attend(q, k, v, mask, cpu_kernel: bool = False):
    """Grouped-query attention of new queries over the cache.

    q: [B, T, H, D]; k, v: [B, S, K, D]; mask: [B, T, S] bool (True: may attend), or a
    `PrefixTreeMask` (every decode-time step), which reads only the occupied prefix: on the CPU the
    native kernel (`cpu_kernel`, `cpu_kernels.attention`), or XLA in key blocks up to the run-time
    length, so a step's cost does not grow with the cache's size. Returns [B, T, H*D].
    """
    d = q.shape[-1]
    if _step(mask) and _on_cpu_kernel(cpu_kernel) and k.dtype == v.dtype:
        from cpu_kernels.attention import MAX_HEAD

        if d <= MAX_HEAD:  # a cache held as bits (`cache.BITS`) goes to the kernel as it is
            return _kernel_attend(q, k, v, mask)
    k, v = kv.floats(k), kv.floats(v)
    if isinstance(mask, PrefixTreeMask):
        return _xla_prefix_attend(q, k, v, mask)
    return _xla_attend(q, k, v, mask)


@jax.jit  # traced once per shape, not once per layer (as `quant.dot`); XLA inlines the calls
def _kernel_attend(q, k, v, mask: PrefixTreeMask):
    return jax.lax.platform_dependent(q, k, v, mask, cpu=_cpu_attend,
                                      default=lambda q, k, v, mask: _xla_prefix_attend(q, kv.floats(k), kv.floats(v), mask))


def _cpu_attend(q, k, v, mask: PrefixTreeMask):
    from cpu_kernels.attention import attention

    b, t, h, d = q.shape
    return attention(q, k, v, mask.lengths, mask.tree, d ** -0.5).reshape(b, t, h * d)


def _xla_prefix_attend(q, k, v, mask: PrefixTreeMask):
    b, t, h, d = q.shape
    if k.shape[1] > KEY_BLOCK:
        out = _attend_prefix(_grouped(q, k.shape[2]) * (d ** -0.5), k, v, mask, h // k.shape[2])
        return _ungrouped(out, t)
    return _xla_attend(q, k, v, mask.dense(k.shape[1]))


def _xla_attend(q, k, v, mask):
    """Dense-mask attention: a KV head's query group folded into the rows of one matmul ([G*T, D] x
    [D, S]), which XLA runs faster than a batched matmul over a separate group axis."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    g = h // kv_heads
    scores = jnp.einsum("bkqd,bskd->bkqs", _grouped(q, kv_heads), k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(jnp.tile(mask, (1, g, 1))[:, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return _ungrouped(jnp.einsum("bkqs,bskd->bkqd", probs, v, preferred_element_type=q.dtype), t)


def _grouped(q, kv_heads: int):
    """[B, T, H, D] -> [B, K, G*T, D]: each KV head's query group as rows of one matmul."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)


def _ungrouped(out, t: int):
    b, kv_heads, gt, d = out.shape
    return out.reshape(b, kv_heads, gt // t, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, -1)


def _attend_prefix(q, k, v, mask: PrefixTreeMask, g: int):
    """Online-softmax attention over key blocks up to `mask.extent`: a loop with a run-time trip count.

    q: scaled [B, K, G*T, D]. A block past the buffer's end is read from S - KEY_BLOCK instead, with
    the slots already seen masked. A block a row cannot see adds exp(MASKED - m) = 0, or, before the
    row's first visible key, weight that key's arrival wipes out (its correction factor underflows to 0).
    """
    s = k.shape[1]

    def body(i, carry):
        m, l, acc = carry
        start = jnp.minimum(i * KEY_BLOCK, s - KEY_BLOCK)
        slots = start + jnp.arange(KEY_BLOCK)
        kb, vb = (jax.lax.dynamic_slice_in_dim(x, start, KEY_BLOCK, axis=1) for x in (k, v))
        allowed = mask.over(slots) & (slots >= i * KEY_BLOCK)[None, None]                   # [B, T, blk]
        scores = jnp.einsum("bkqd,bskd->bkqs", q, kb, preferred_element_type=jnp.float32)
        scores = jnp.where(jnp.tile(allowed, (1, g, 1))[:, None], scores, MASKED)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.exp(scores - m_new[..., None])
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("bkqs,bskd->bkqd", p.astype(v.dtype), vb,
                                                  preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1), acc

    init = (jnp.full(q.shape[:3], MASKED, jnp.float32), jnp.zeros(q.shape[:3], jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    blocks = (jnp.minimum(mask.extent, s) + KEY_BLOCK - 1) // KEY_BLOCK
    _, l, acc = jax.lax.fori_loop(0, blocks, body, init)
    return (acc / l[..., None]).astype(q.dtype)


class Attention(nn.Module):
    """Rotary grouped-query attention: writes the new K/V at `slots`, attends over the cache under `mask`."""
    config: ModelConfig

    @nn.compact
    def __call__(self, h, layer_cache, *, cos, sin, slots, mask, lora=None):
        c = self.config
        b, t, d = h.shape
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if c.arch == "phi3" or self.has_variable("params", "qkv"):
            qkv = linear(self, "qkv", (d, q_size + 2 * kv_size), h, lora)
            q, k, v = qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]
            if c.arch != "phi3":  # a Llama's q, k and v joined for a GPU (quant.lay_out_for_gpu); adapters stay apart
                q, k, v = (x if (u := lora_update(h, lora, name, c.cpu_kernel)) is None else x + u
                           for name, x in zip(("q", "k", "v"), (q, k, v)))
        else:
            q, k, v = (linear(self, n, (d, size), h, lora) for n, size in (("q", q_size), ("k", kv_size), ("v", kv_size)))
        q = apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        out, layer_cache = write_and_attend(q, k, v, layer_cache, slots, mask, c.attention, c.cpu_kernel)
        return linear(self, "o", (q_size, d), out, lora), layer_cache


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(h)) * up(h))."""
    config: ModelConfig

    @nn.compact
    def __call__(self, h, lora=None):
        d, f = self.config.hidden_size, self.config.intermediate_size
        if self.config.arch == "phi3" or self.has_variable("params", "gate_up"):
            gate, up = jnp.split(linear(self, "gate_up", (d, 2 * f), h, lora), 2, axis=-1)
            if self.config.arch != "phi3":  # a Llama's gate and up joined for a GPU (quant.lay_out_for_gpu)
                gate, up = (x if (u := lora_update(h, lora, name, self.config.cpu_kernel)) is None else x + u
                            for name, x in (("gate", gate), ("up", up)))
        else:
            gate, up = linear(self, "gate", (d, f), h, lora), linear(self, "up", (d, f), h, lora)
        return linear(self, "down", (f, d), jax.nn.silu(gate) * up, lora)


class Block(nn.Module):
    """Pre-norm decoder layer. `run_attn`/`run_mlp` are Python bools (a static plan: a skipped sub-layer
    is never traced) or traced flags (a `DynamicPlan`: each sub-layer under `nn.cond`, one executable
    for every plan, and a skipped sub-layer still does no work)."""
    config: ModelConfig

    def setup(self):
        # The Pallas norms go with the Pallas attention (a GPU's decode steps), and the CPU kernels take precedence.
        eps, pallas = self.config.rms_norm_eps, self.config.attention == "pallas" and not _on_cpu_kernel(self.config.cpu_kernel)
        self.attn_norm, self.attn = RMSNorm(eps, pallas), Attention(self.config)
        self.mlp_norm, self.mlp = RMSNorm(eps, pallas), MLP(self.config)

    def attention(self, x, layer_cache, rope, slots, mask, lora):
        y, layer_cache = self.attn(self.attn_norm(x), layer_cache, cos=rope[0], sin=rope[1], slots=slots, mask=mask,
                                   lora=lora)
        return x + y, layer_cache

    def feed_forward(self, x, lora):
        return x + self.mlp(self.mlp_norm(x), lora)

    def __call__(self, x, layer_cache, *, rope, slots, mask, lora=None, run_attn=True, run_mlp=True, residual=None,
                 defer: bool = False):
        """(x, layer_cache) for the stream x + `residual` (None: x alone). With `defer` (a static plan), the last
        sub-layer's output is not added: ((x, y), layer_cache) for the stream x + y, whose add the next norm takes
        (one kernel on a GPU: `RMSNorm`'s `pallas`). The adds are the same, in the same order, either way."""
        if isinstance(run_attn, bool):
            y = residual
            if run_attn:
                x, h = _add_norm(self.attn_norm, x, y)
                y, layer_cache = self.attn(h, layer_cache, cos=rope[0], sin=rope[1], slots=slots, mask=mask, lora=lora)
            if run_mlp:
                x, h = _add_norm(self.mlp_norm, x, y)
                y = self.mlp(h, lora)
            if defer:
                return (x, y), layer_cache
            return (x if y is None else x + y), layer_cache
        x = x if residual is None else x + residual
        x, layer_cache = nn.cond(run_attn, lambda m, x, c: m.attention(x, c, rope, slots, mask, lora),
                                 lambda m, x, c: (x, c), self, x, layer_cache)
        x = nn.cond(run_mlp, lambda m, x: m.feed_forward(x, lora), lambda m, x: x, self, x)
        return ((x, None) if defer else x), layer_cache


def _add_norm(norm: RMSNorm, x, y):
    """(x + y, its norm), or (x, x's norm) where y is None."""
    return (x, norm(x)) if y is None else norm(x, y)
