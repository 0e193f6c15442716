"""The CPU decode matmul (`cpu_kernels`) against its jnp reference, for every weight dtype and layout; each
row bit-identical to the same row alone; bad input refused; the model on it against XLA's dot. The kernel
tests run once on this CPU's widest vector unit and, in a subprocess, on each narrower one (AVX2, and AVX-512
without BF16)."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import matmul as cm
from s3djax import cache as kv
from s3djax import methods, quant
from s3djax.decode import Runner

pytestmark = pytest.mark.skipif(cm.unavailable() is not None, reason=f"CPU kernel: {cm.unavailable()}")

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}
# (M, K, N): decode shapes, odd K and N (ragged vectors), one K, rows past every register block, and K in
# several L1 chunks under several register blocks.
SHAPES = [(1, 576, 192), (2, 77, 129), (5, 577, 1), (7, 300, 70), (9, 16, 33), (17, 31, 70), (32, 100, 64)]


def inputs(m, k, n, dtype, layout, seed=0, x_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), x_dtype)
    if dtype == jnp.int8:
        w = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
        scale = jnp.asarray(rng.uniform(0.5, 2.0, n) / (64 * np.sqrt(k)), jnp.float32)
    else:
        w, scale = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k), dtype), None
    if layout == "nk":
        w = w.T
    elif layout in cm.PACKED_ROWS:
        w = cm.pack(w, cm.panel(), cm.PACKED_ROWS[layout])
    return x, w, scale


def cases(shapes, layouts=cm.LAYOUTS, dtypes=tuple(DTYPES)):
    """(m, k, n, dtype, layout, x's dtype) for every weight dtype and layout each takes, over `shapes`: pairs
    (bfloat16 only) at an even K, with x in float32 and in bfloat16 (the pair instruction's case); W8A8's quads (int8
    only) at K rounded up to a multiple of its blocks."""
    for dtype in (DTYPES[name] for name in dtypes):
        for layout in layouts:
            if (layout == "pairs" and dtype != jnp.bfloat16) or (layout == "quads" and dtype != jnp.int8):
                continue
            for x_dtype in (jnp.float32, jnp.bfloat16) if dtype == jnp.bfloat16 else (jnp.float32,):
                for m, k, n in shapes:
                    if layout in cm.PACKED_ROWS:
                        n = cm.panel() * (1 + n // 100)
                    if layout == "quads":
                        k = -(-k // cm.QUANT_BLOCK) * cm.QUANT_BLOCK
                    yield m, k + k % 2 if layout == "pairs" else k, n, dtype, layout, x_dtype


def check_all(layouts=cm.LAYOUTS, dtypes=tuple(DTYPES)):
    """Every dtype, layout and shape: close to the reference, and each row bit-identical to itself alone."""
    for m, k, n, dtype, layout, x_dtype in cases(SHAPES, layouts, dtypes):
        x, w, scale = inputs(m, k, n, dtype, layout, x_dtype=x_dtype)
        product = jax.jit(lambda x, w, s: cm.matmul(x, w, s, layout))
        got, want = product(x, w, scale), cm.reference(x, w, scale, layout)
        assert got.shape == (m, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(want).max()))
        alone = jnp.concatenate([product(x[i:i + 1], w, scale) for i in range(m)])
        assert (np.asarray(alone) == np.asarray(got)).all(), (dtype, layout, x_dtype, (m, k, n))




def test_kernel_against_reference_and_rows_alone():
    check_all()


def test_every_blocking_the_tuner_may_pick_gives_the_same_bits():
    """Prefetch distance, K chunk, rows a tile holds and a few rows' panels change how the loops run, never a result: under every
    combination in the tuner's search, every dtype and layout gives the bits of the fixed blocking, row by row."""
    import itertools

    from s3djax import kernel_tuning

    space = {}
    for settings, *_ in kernel_tuning.SEARCH:
        space.update(settings)
    fixed = kernel_tuning.fallback()
    products = []
    # One to three rows over 3 and 4 panels: the tiles of two panels a few rows may take, and a last one of one.
    for m, k, n, dtype, layout, x_dtype in cases([(1, 577, 200), (1, 577, 300), (2, 577, 300), (3, 577, 200),
                                                  (5, 577, 70), (9, 1030, 129), (17, 300, 33), (33, 64, 200)]):
        x, w, scale = inputs(m, k, n, dtype, layout, x_dtype=x_dtype)
        product = jax.jit(lambda x, w, s, layout=layout: cm.matmul(x, w, s, layout))
        products.append((product, x, w, scale))
    try:
        cm.set_blocking(fixed)
        want = [np.asarray(product(x, w, s)) for product, x, w, s in products]
        for values in itertools.product(*space.values()):
            cm.set_blocking(dict(zip(space, values)))
            assert cm.blocking() == dict(zip(space, values))
            for (product, x, w, s), expected in zip(products, want):
                assert (np.asarray(product(x, w, s)) == expected).all(), (values, x.shape, w.dtype)
    finally:
        cm.set_blocking(fixed)
    with pytest.raises(ValueError, match="no blocking"):
        cm.set_blocking({**fixed, "tile_rows": 0})
    assert cm.blocking() == fixed


def on_avx2(module: str, isa: str = "avx2", call: str = "check_all()"):
    """Run `module`'s `call` in a subprocess on a narrower ISA's loops: AVX2 (what a CPU without AVX-512 runs), or
    AVX-512 without BF16 where this CPU has it."""
    if cm.isa() == isa or (isa == "avx512" and cm.isa() != "avx512-bf16"):
        pytest.skip(f"this CPU runs the {cm.isa()} loops: the test against the reference covers them")
    code = f"from {module} import check_all; from cpu_kernels import matmul; " \
           f"assert matmul.isa() == {isa!r}, matmul.isa(); {call}"
    env = {**os.environ, "S3DJAX_CPU_ISA": isa}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernel_on_avx2():
    on_avx2("tests.test_cpu_matmul")


def test_kernel_on_avx512_without_bf16():
    """Where the CPU has AVX-512 BF16 and VNNI, the AVX-512 loops without them (the same template, other flags) on
    bfloat16 and int8, the dtypes whose loops the two differ in (pairs, and W8A8's quads on fmas)."""
    on_avx2("tests.test_cpu_matmul", "avx512", "check_all(dtypes=('bf16', 'int8'))")


def test_pack_round_trip_and_gradient():
    x, w, _ = inputs(3, 20, cm.panel() * 2, jnp.float32, "kn")
    packed = cm.pack(w, cm.panel())
    assert packed.shape == w.shape and not (packed == w).all()
    assert (cm.unpack(packed, cm.panel()) == w).all()
    pairs, quads = cm.pack(w, cm.panel(), 2), cm.pack(w, cm.panel(), 4)
    assert not (pairs == packed).all() and (cm.unpack(pairs, cm.panel(), 2) == w).all()
    assert not (quads == pairs).all() and (cm.unpack(quads, cm.panel(), 4) == w).all()
    # Panel p, rows 2i and 2i + 1 (4i to 4i + 3): column c's two (four) values side by side.
    p, i, c = 1, 3, 5
    assert pairs.reshape(-1)[((p * 10 + i) * cm.panel() + c) * 2:][:2].tolist() == \
        [w[2 * i, p * cm.panel() + c], w[2 * i + 1, p * cm.panel() + c]]
    assert quads.reshape(-1)[((p * 5 + i) * cm.panel() + c) * 4:][:4].tolist() == \
        [w[4 * i + j, p * cm.panel() + c] for j in range(4)]
    grad = jax.grad(lambda x: cm.matmul(x, packed, None, "panels").sum())(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: (x @ w).sum())(x), rtol=1e-6)


@pytest.mark.parametrize("k, w, layout", [(8, jnp.ones((8, 4), jnp.float16), "kn"),   # unsupported dtype
                                          (8, jnp.ones((7, 4), jnp.float32), "kn"),     # K disagrees
                                          (8, jnp.ones((8, 65), jnp.float32), "panels"),  # panels do not divide N
                                          (8, jnp.ones((8, 64), jnp.float32), "pairs"),  # pairs are bfloat16
                                          (7, jnp.ones((7, 64), jnp.bfloat16), "pairs"),  # over an even K
                                          (32, jnp.ones((32, 64), jnp.float32), "quads"),  # quads are int8
                                          (33, jnp.ones((33, 64), jnp.int8), "quads")])  # over K in blocks of 32
def test_bad_input_is_a_clear_error(k, w, layout):
    with pytest.raises(ValueError, match="the CPU matmul takes"):
        cm.matmul(jnp.ones((2, k)), w, None, layout)


def test_handler_refuses_bad_buffers_without_crashing():
    """Past the wrapper's checks, the handler itself returns an error for mismatched buffers."""
    call = jax.ffi.ffi_call(cm.TARGET, jax.ShapeDtypeStruct((2, 4), jnp.float32))
    none = np.int32(0)
    with pytest.raises(Exception, match="x and w disagree on K"):
        jax.block_until_ready(call(jnp.ones((2, 8)), jnp.ones((7, 4)), jnp.zeros((0,)), layout=none, x_bf16=none))
    with pytest.raises(Exception, match="weights must be"):
        jax.block_until_ready(call(jnp.ones((2, 8)), jnp.ones((8, 4), jnp.int32), jnp.zeros((0,)), layout=none,
                                   x_bf16=none))
    pairs = jax.ffi.ffi_call(cm.TARGET, jax.ShapeDtypeStruct((2, cm.panel()), jnp.float32))
    with pytest.raises(Exception, match="pairs must be bfloat16 with K even"):
        jax.block_until_ready(pairs(jnp.ones((2, 7)), jnp.ones((7, cm.panel()), jnp.bfloat16), jnp.zeros((0,)),
                                    layout=np.int32(3), x_bf16=none))
    with pytest.raises(Exception, match="quads must be int8 with K a multiple of 32"):
        jax.block_until_ready(pairs(jnp.ones((2, 40)), jnp.ones((40, cm.panel()), jnp.int8), jnp.ones((cm.panel(),)),
                                    layout=np.int32(4), x_bf16=none))


def test_unavailable_kernel_falls_back_with_one_line():
    code = ("import pathlib, jax.numpy as jnp; from cpu_kernels import matmul; from s3djax import quant; "
            "matmul.LIBRARY = pathlib.Path('/nonexistent/lib.so'); "
            "y = quant.dot(jnp.ones((2, 8)), jnp.ones((8, 4)), True); quant.dot(jnp.ones((3, 8)), jnp.ones((8, 4)), True); "
            "assert float(y[0, 0]) == 8.0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "kernel" in line]
    assert len(lines) == 1 and "is not built" in lines[0] and "using XLA's dot" in lines[0], done.stderr


def test_the_per_isa_objects_share_no_code():
    # Inline code two translation units both emit (a std:: container's, say) is a weak symbol the linker keeps one
    # copy of: if it kept the AVX-512 one, an AVX2-only CPU would die on it. The per-ISA objects must define none.
    objects = sorted(cm.LIBRARY.parent.glob("CMakeFiles/*/avx*.cc.o"))
    if not objects or subprocess.run(["which", "nm"], capture_output=True).returncode:
        pytest.skip("no object files or no nm")
    for o in objects:
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(o)], capture_output=True, text=True).stdout
        weak = [line for line in symbols.splitlines() if line.split(" ", 2)[1:2] in (["W"], ["V"], ["u"])]
        assert not weak, f"{o.name} defines shared inline code: {weak[:5]}"


def test_a_failed_build_is_one_line_and_leaves_xla(tmp_path):
    code = ("import pathlib, sys; from cpu_kernels import build; build.BUILD = pathlib.Path(sys.argv[1]); "
            "sys.exit(build.main())")
    env = dict(os.environ, PATH=str(tmp_path))  # no cmake on the PATH
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "build")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 0 and len(lines) == 1 and "cmake is not installed" in lines[0], done.stderr


def test_switch_turns_it_off_silently():
    code = "from cpu_kernels import matmul; assert not matmul.usable() and 'S3DJAX_CPU_KERNEL' in matmul.unavailable()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, cm.SWITCH: "0"},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "kernel" not in done.stderr, done.stderr


def on_path(model, kernel: bool):
    return dataclasses.replace(model, config=model.config.replace(cpu_kernel=kernel))


def test_model_logits_match_xla(smollm2):
    """SmolLM2's forward through packed weights and the kernel against XLA's dot, prefill and decode steps."""
    prompt = [(7 * i) % 1000 + 100 for i in range(24)]
    logits = {}
    for kernel in (True, False):
        built = methods.build("ar", on_path(smollm2, kernel), max_cache_len=64)
        assert any(isinstance(w, quant.Packed) for w in jax.tree.leaves(built.params, is_leaf=quant.is_weight)) \
            == kernel
        runner = Runner(built.decoder, built.params)
        state = runner.prefill(prompt)
        # A dense mask (XLA's attention) and the decode mask (the native attention where the kernel runs).
        for mask in (jnp.ones((1, 3, 64), bool).at[:, :, 27:].set(False), kv.causal(jnp.asarray([24]), 3)):
            hidden, _ = built.decoder._step(built.params, jnp.asarray([[5, 6, 7]]), jnp.asarray([[24, 25, 26]]),
                                            state["cache"], jnp.asarray([24]), mask)
            logits[kernel, type(mask) if isinstance(mask, kv.PrefixTreeMask) else jax.Array] = np.asarray(built.decoder._logits(built.params, hidden))
    for mask in (jax.Array, kv.PrefixTreeMask):
        got, want = logits[True, mask], logits[False, mask]
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("quantization", ["int8-all", "w8a8"])
def test_speculative_methods_match_ar_on_the_kernel_in_int8(quantization):
    """Greedy s3d and kangaroo through the kernel give ar's tokens in int8, weight-only and W8A8, tables packed too (in
    fp32 the kernel is the CPU's default path, which every SmolLM2 test takes; bfloat16:
    tests/test_optimized_compile.py), over a bfloat16 KV cache. The context grows across the attention kernel's first
    piece boundary (256 keys), where a verify pass holds rows of one piece and of two."""
    from s3djax.loading import load_model

    model = load_model("smollm2-135m", quantization=quantization, progress=False)
    prompt = [(7 * i) % 1000 + 100 for i in range(244)]
    tokens = {}
    # Drafting inside the verify pass too, whose 9 rows a step once had their norms summed otherwise than alone.
    for method, options in (("ar", {}), ("s3d", {}), ("kangaroo", {}), ("s3d", dict(in_verify="on", gamma=2))):
        built = methods.build(method, on_path(model, True), max_cache_len=512, kv_dtype="bfloat16", **options)
        assert getattr(built.decoder, "ar", built.decoder).cache_dtype == "bfloat16"
        name = method + ("-in-verify" if options else "")
        tokens[name] = Runner(built.decoder, built.params).generate(prompt, 24).tokens
        if quantization == "w8a8":  # every product of the target and of the drafts' int8 copies in integers
            packed = [w for w in jax.tree.leaves(built.params, is_leaf=quant.is_weight) if quant.is_int8(w)]
            assert packed and all(isinstance(w, quant.Packed) and w.layout == "quads" for w in packed)
    assert tokens["s3d"] == tokens["ar"] == tokens["kangaroo"] == tokens["s3d-in-verify"]
    assert len(tokens["ar"]) == 24


def test_a_bfloat16_model_packs_its_weights_in_pairs():
    """Every bfloat16 linear and table of a bfloat16 SmolLM2 goes in pairs of rows (K is even throughout); the draft's
    int8 weights stay in plain panels."""
    from s3djax.loading import load_model

    built = methods.build("s3d", load_model("smollm2-135m", dtype="bfloat16", progress=False), max_cache_len=64,
                          dtype="bfloat16")
    packed = [w for w in jax.tree.leaves(built.params, is_leaf=quant.is_weight) if isinstance(w, quant.Packed)]
    assert any(w.layout == "pairs" for w in packed)
    assert all((w.layout == "pairs") == (w.values.dtype == jnp.bfloat16) for w in packed)
    table = next(w for w in packed if w.table and w.layout == "pairs")
    ids = jnp.asarray([0, 5, 12345])
    assert (np.asarray(quant.rows(table, ids)) == np.asarray(table.unpacked()[ids])).all()


def test_w8a8_is_the_integer_product_of_int8_activations_on_xla_too(smollm2):
    """W8A8 on XLA's path (a GPU's, and a CPU without the kernel) is the kernel's product: x quantized to the same int8
    values (ffi.cc's QuantizeRows and `quantize_rows`, ties to even), each block's integer dot exact; and on SmolLM2's
    own activations a layer's products agree with the kernel's to fp32 rounding. Its quantization is of the input:
    a row scaled by a power of two gives the same values, and an all-zero block gives zeros, not NaN."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 96)), jnp.float32).at[1, 32:64].set(0.0)
    q, d = cm.quantize_rows(x)
    assert q.dtype == jnp.int8 and q.shape == (4, 3, 32) and (np.abs(np.asarray(q)).max(-1) == 127).sum() == 11
    assert (np.asarray(cm.quantize_rows(4 * x)[0]) == np.asarray(q)).all() and float(d[1, 1]) == 0.0
    w = jnp.asarray(np.random.default_rng(4).integers(-127, 128, (96, cm.panel())), jnp.int8)
    scale = jnp.full((cm.panel(),), 0.01, jnp.float32)
    exact = np.einsum("mbk,bkn->mbn", np.asarray(q, np.int64), np.asarray(w, np.int64).reshape(3, 32, -1))
    want = (exact * np.asarray(d, np.float64)[..., None]).sum(1) * 0.01
    for got in (cm.int8_reference(x, w, scale), cm.matmul(x, cm.pack(w, cm.panel(), 4), scale, "quads")):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        assert np.isfinite(np.asarray(got)).all()
    params = quant.apply({"layers_0": smollm2.params["layers_0"]}, "w8a8", jnp.float32)
    packed = quant.pack_for_cpu(params)
    h = jnp.asarray(np.random.default_rng(5).standard_normal((3, 576)), jnp.float32)
    for name in ("q", "gate"):
        plain = params["layers_0"]["attn" if name == "q" else "mlp"][name]
        assert quant.is_a8(plain) and quant.mode_of(params) == "w8a8"
        joined = packed["layers_0"]["attn" if name == "q" else "mlp"]["qkv" if name == "q" else "gate_up"]
        got = np.asarray(quant.dot(h, joined))[:, :plain.shape[1]]
        np.testing.assert_allclose(got, np.asarray(quant.dot(h, plain)), rtol=1e-5, atol=1e-5 * np.abs(got).max())
