"""How a native call is vmapped: the mapped axis folded into the call's own leading axis, one call for the batch.

XLA's FFI maps a call it cannot batch by looping over the mapped axis ("sequential"), one native call per element:
a vmapped decoder (thousands of sampled continuations in one call, `tests/test_lossless_sampling.py`) spent most of
its time in that loop's slicing around tens of thousands of tiny calls. Both kernels treat the rows of their leading
axis independently (a product's row i is bit-identical to the row alone; an attention row reads its own batch's
cache), so folding the mapped axis into it computes what the loop computed, in one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def folded(call, foldable: tuple[bool, ...]):
    """`call(*args)` vmapped by folding: every operand marked foldable has the call's leading axis (the rows), and
    the mapped axis is merged into it (operands not mapped are broadcast); where an operand not foldable is mapped
    (a product's weights), the elements are mapped one at a time, as XLA's sequential rule did."""

    @jax.custom_batching.custom_vmap
    def batched(*args):
        return call(*args)

    @batched.def_vmap
    def _rule(axis_size, in_batched, *args):
        if any(b and not f for b, f in zip(in_batched, foldable)):
            full = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
            return jax.lax.map(lambda xs: batched(*xs), full), True
        lead = next(a.shape[1] for a, b in zip(args, in_batched) if b)
        flat = [(a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)).reshape((axis_size * lead,) + a.shape[1 + b:])
                if f else a for a, b, f in zip(args, in_batched, foldable)]
        out = batched(*flat)
        return out.reshape((axis_size, lead) + out.shape[1:]), True

    return batched
