"""The S3D speed model against the paper's own numbers, its fits against known answers, and one tiny
measurement end to end."""

import types

import numpy as np
import pytest

from s3djax import analysis as an
from s3djax.generator import Generator
from s3djax.skip_plan import SkipPlan
from tiny import TINY, random_params


@pytest.mark.parametrize("beta, expected", [
    # Eq. 10 at the paper's U = 0.01 (Appendix E): (1 - 10^(-2 beta)) / 0.99. 0.375 is its Fig. 9
    # beta (12 of 32 layers), 0.5 its optimum; alpha(0) = 0 and alpha(1) = 1 as the paper requires.
    (0.0, 0.0), (0.25, 0.690679), (0.375, 0.830477), (0.5, 0.909091), (0.75, 0.978159), (1.0, 1.0)])
def test_alpha_of_beta_reproduces_the_papers_curve(beta, expected):
    assert an.alpha_of_beta(beta, 0.01) == pytest.approx(expected, abs=1e-6)


def test_alpha_of_beta_limits():
    assert np.allclose(an.alpha_of_beta([0.2, 0.7], 1.0), [0.2, 0.7])           # U = 1: the diagonal
    assert an.alpha_of_beta(0.5, 1.0 + 1e-7) == pytest.approx(0.5, abs=1e-6)    # continuous there
    assert an.alpha_of_beta(0.5, 100.0) < 0.5 < an.alpha_of_beta(0.5, 0.01)


def test_tau_is_the_capped_geometric_series():
    # The paper's footnote: with one alpha at every depth, Eq. 11 is Leviathan et al.'s closed form.
    for a, gamma in [(0.0, 4), (0.6, 1), (0.6, 4), (0.9, 5), (1.0, 3)]:
        closed = gamma + 1 if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)
        assert an.tau_of_alphas([a] * gamma) == pytest.approx(closed)
    # Conditional alphas: P(exactly 0) = 0.5, P(1) = 0.5 * 0.5, P(2) = 0.25: 1*.5 + 2*.25 + 3*.25 = 1.75.
    assert an.tau_of_alphas([0.5, 0.5]) == pytest.approx(1.75)


def test_discount_and_improvement_factor():
    assert np.allclose(an.discounted(0.8, 5), [0.8, 0.6, 0.4, 0.2, 0.0])         # Eq. 14, slope 1/4
    tau = an.tau_model(4, 0.5)
    assert tau == pytest.approx(an.tau_of_alphas(an.discounted(an.alpha_of_beta(0.5), 4)))
    assert an.improvement_factor(tau, 0.5) == pytest.approx(tau / 1.54)          # delta = 0.04


def test_fits_recover_known_parameters():
    betas = np.linspace(0.1, 0.9, 9)
    for u in (0.01, 0.3, 5.0):
        assert an.fit_u(betas, an.alpha_of_beta(betas, u)) == pytest.approx(u, rel=1e-3)
    rows = [an.discounted(a, 4, 0.15) for a in (0.3, 0.6, 0.9)] + [[0.0, 0.0, 0.0, 0.0]]
    assert an.fit_slope(rows) == pytest.approx(0.15)
    taus, betas = np.array([1.5, 2.0, 2.5]), np.array([0.3, 0.5, 0.7])
    assert an.fit_delta(betas, taus, taus / (0.2 + betas + 1)) == pytest.approx(0.2)


def test_step_times_to_tokens_per_s():
    ms = {"ar_step_ms": 40.0, "draft_step_ms": 20.0, "verify_step_ms": 60.0}
    assert an.iteration_cost(ms) == 2.0
    assert an.predicted_tokens_per_s(2.0, ms) == pytest.approx(25.0)
    assert an.ar_tokens_per_s(ms) == 25.0


def test_skip_schemes_skip_equally_many_layers():
    schemes = an.skip_schemes(30, 14)
    assert {k: p.spec() for k, p in schemes.items() if k != "alternating"} == {
        "symmetric middle": "8-21", "early exit": "16-29", "late only": "0-13"}
    for plan in schemes.values():
        assert plan.attn.count(False) == 14
        assert an.beta(plan, TINY.replace(num_layers=30)) == pytest.approx(16 / 30)
    alternating = schemes["alternating"].attn
    assert alternating[0] and alternating[-1] and not any(not a and not b for a, b in zip(alternating, alternating[1:]))
    assert an.window(30, 14, 8) == schemes["symmetric middle"]
    # Sub-layer plans weigh attention and MLP by their parameter counts.
    c = TINY
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    assert an.beta(SkipPlan.parse("0-3.attn", 4), TINY) == pytest.approx(mlp / (attn + mlp))


def test_the_shipped_plan_is_the_one_the_shipped_draft_file_records():
    from s3djax.speculative.drafters.s3d import default_plan

    plan = an.shipped_plan("smollm2-135m", 30)
    assert plan.spec() == "14-15"  # the 28-layer draft of 2026-11-28, not the untrained default's 8-21
    assert plan != default_plan(30)


@pytest.fixture(scope="module")
def tiny_loaded():
    from s3djax.loading import LoadedModel

    # build() reads only the tokenizer's EOS and pad ids; the prompts here are raw ids.
    no_tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=0)
    return LoadedModel("tiny", TINY, random_params(TINY, 0), no_tokenizer, 0.0)


def test_measure_pools_acceptance_and_times_steps(tiny_loaded):
    prompts = [{"ids": [1, 2, 3, 4, 5]}, {"ids": [7, 8, 9]}, {"ids": list(range(10, 130))}]
    prompts = an.fitting(prompts, max_cache_len=64, max_new_tokens=12)
    assert len(prompts) == 2
    gen = Generator.from_model(tiny_loaded, max_cache_len=64)
    m = an.measure(gen, prompts, gamma=3, skip="1-2", draft_path="none", max_new_tokens=12, step_times=True,
                   step_repeats=1)
    assert (m.skip, m.gamma, len(m.alpha), m.prompts, m.beta) == ("1-2", 3, 3, 2, 0.5)
    assert 1.0 <= m.tau <= 4.0 and m.verify_steps >= 2 * 11 / 4 and m.tokens == 22
    assert set(m.step_ms) == {"ar_step_ms", "draft_step_ms", "verify_step_ms"}
    assert m.row()["alpha_1"] == m.alpha[0]
    ar = an.measure(gen, prompts, method="ar", max_new_tokens=12)
    assert (ar.tau, ar.tokens, ar.alpha) == (1.0, 22, []) and ar.tokens_per_s > 0
