"""The CPU matmul's blocking chosen on the machine at hand: the search picks the fastest of a cost table, the choice is
measured once per machine and kernel build and cached, a bad cache is ignored with one line, S3DJAX_DEFAULTS=fixed
takes the data file, and a real measurement stays in the search space."""

import json
import os

import numpy as np
import pytest

from cpu_kernels import matmul as cm
from s3djax import defaults, device, kernel_tuning, user_cache

pytestmark = pytest.mark.skipif(cm.unavailable() is not None, reason=f"CPU kernel: {cm.unavailable()}")


def cost_table(best: dict):
    """Milliseconds that grow with each setting's distance from `best` (prefetching helps only up to its best), and
    with the rows."""
    def time_ms(blocking, m, weights):
        miss = sum(abs(blocking[k] - v) / (v or 1) for k, v in best.items())
        return m * (1.0 + 0.1 * miss)
    return time_ms


def test_the_search_picks_the_fastest_blocking_of_a_cost_table():
    start = kernel_tuning.fallback()
    for best in ({"prefetch": 2048, "chunk_bytes": 32 << 10, "tile_rows": 32, "pair_dot": 1, "row_panels": 2},
                 {"prefetch": 0, "chunk_bytes": 8 << 10, "tile_rows": 16, "pair_dot": 0, "row_panels": 1}):
        assert kernel_tuning.choose(cost_table(best), start) == best
    # Equal times: the first listed candidate of every stage.
    first = {"prefetch": 0, "chunk_bytes": 8 << 10, "tile_rows": 16, "pair_dot": 0, "row_panels": 1}
    assert kernel_tuning.choose(lambda b, m, weights: 1.0, start) == first
    # Each stage times only its own rows and weights, with the earlier stages' choices held; the pair instruction's
    # stage only where the vector unit has one (else the start's setting stays).
    seen = []
    kernel_tuning.choose(lambda b, m, weights: seen.append((m, b["prefetch"], weights, b["pair_dot"])) or 1.0, start)
    assert {m for m, *_ in seen} == {1, 3, 5, 9, 17} and {p for m, p, *_ in seen if m in (9, 17)} == {0}
    assert {w for *_, w, dot in seen if dot} == {"bf16"} and {(m, w) for m, _, w, _ in seen if w == "bf16"} == \
        {(5, "bf16"), (17, "bf16")}
    best = {"prefetch": 0, "chunk_bytes": 8 << 10, "tile_rows": 16, "pair_dot": 1, "row_panels": 1}
    assert kernel_tuning.choose(cost_table(best), start, pair_dot=False)["pair_dot"] == start["pair_dot"] == 0


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """A user's cache; measuring returns `chosen` and counts calls; the kernel's blocking is restored afterwards."""
    monkeypatch.setenv("S3DJAX_CACHE", str(tmp_path))
    monkeypatch.setenv(defaults.ENV, "measure")
    state = {"calls": 0, "chosen": {"prefetch": 4096, "chunk_bytes": 32 << 10, "tile_rows": 32, "pair_dot": 0,
                                    "row_panels": 2}}

    def measure():
        state["calls"] += 1
        return dict(state["chosen"])
    monkeypatch.setattr(kernel_tuning, "measure", measure)
    kernel_tuning.ensure.cache_clear()
    yield state
    kernel_tuning.ensure.cache_clear()
    cm.set_blocking(kernel_tuning.fallback())


def ensure():
    kernel_tuning.ensure.cache_clear()  # a new process
    return kernel_tuning.ensure()


def test_the_blocking_is_measured_once_per_machine_and_kernel_build(tuner, monkeypatch, capsys):
    assert ensure() == tuner["chosen"] and cm.blocking() == tuner["chosen"] and tuner["calls"] == 1
    err = capsys.readouterr().err
    assert "tuning the CPU matmul's blocking" in err and "prefetch 4096" in err
    assert ensure() == tuner["chosen"] and tuner["calls"] == 1  # from the cache, silently
    assert capsys.readouterr().err == ""
    # Another CPU or another build of the kernel: measured again.
    monkeypatch.setattr(device, "describe", lambda: "CPU: another (jax 0)")
    ensure()
    monkeypatch.setattr(defaults, "file_sha256", lambda path: "another build")
    ensure()
    assert tuner["calls"] == 3
    # S3DJAX_DEFAULTS=again measures anew; =fixed takes the data file without measuring.
    monkeypatch.setenv(defaults.ENV, "again")
    ensure()
    assert tuner["calls"] == 4
    monkeypatch.setenv(defaults.ENV, "fixed")
    assert ensure() == kernel_tuning.fallback() == cm.blocking() and tuner["calls"] == 4


def test_a_corrupt_or_foreign_cache_is_ignored_with_one_line(tuner, capsys):
    file = user_cache.path(kernel_tuning.TABLE)
    for text in ("{not json", json.dumps({"k": {"prefetch": "far"}}), json.dumps([1])):
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(file, "w") as f:
            f.write(text)
        calls = tuner["calls"]
        assert ensure() == tuner["chosen"] and tuner["calls"] == calls + 1
        err = capsys.readouterr().err.splitlines()
        assert len([line for line in err if line.startswith("note: ignoring")]) == 1, err
    with open(file) as f:
        assert all(set(v) >= {*cm.BLOCKING, "device"} for v in json.load(f).values())


def test_step_times_are_keyed_by_the_blocking():
    """A method's step times (s3djax.defaults) were measured under one blocking: another is another key."""
    try:
        cm.set_blocking(kernel_tuning.fallback())
        before = defaults._key("s3d", {"model": "m"})
        cm.set_blocking({**kernel_tuning.fallback(), "prefetch": 4096})
        assert defaults._key("s3d", {"model": "m"}) != before
    finally:
        cm.set_blocking(kernel_tuning.fallback())


def test_a_real_measurement_stays_in_the_search_space(monkeypatch):
    """Timed on the kernel itself (a small buffer, one round, to be quick): a blocking from the search, and the
    fixed blocking set again afterwards."""
    monkeypatch.setattr(kernel_tuning, "MIN_BYTES", 8 << 20)
    monkeypatch.setattr(kernel_tuning, "MAX_BYTES", 8 << 20)
    monkeypatch.setattr(kernel_tuning, "ROUNDS", 1)
    chosen = kernel_tuning.measure()
    for settings, *_ in kernel_tuning.SEARCH:
        for name, candidates in settings.items():
            assert chosen[name] in candidates
    assert chosen["pair_dot"] == 0 or cm.pair_dot()
    assert cm.blocking() == kernel_tuning.fallback()
    with pytest.raises(ValueError, match="cannot time"):
        cm.time_products(np.zeros(10, np.float32), 1, 576, 1536, 1)
    with pytest.raises(ValueError, match="cannot time"):  # bfloat16 pairs need an even K
        cm.time_products(np.zeros(1 << 20, np.float32), 1, 575, 64, 1, bf16=True)
