"""Acceptance decay and the S3D paper's speed model, measured and fitted (notebooks/acceptance_decay.ipynb).

Three parts, kept apart so the speed model can be tested without loading a network:
- skip schemes at equal beta (the paper's Fig. 4 and 9) and beta, the share of the target it runs;
- measurement: alpha_k by depth, tau and tokens/s for one (draft, skip plan, gamma, tree) over a
  prompt set, and the draft/verify/AR step times that turn a tau into a predicted tokens/s;
- the paper's speed model (Eq. 10-12, with Eq. 14's linear per-depth discount) and least-squares
  fits of its U, slope and delta to measurements.

Notation follows the paper: alpha_k is P(depth k accepted | depth k-1 was), tau the tokens emitted
per verify step (bonus included), beta the fraction of the target's layer parameters the draft runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from s3djax.config import ModelConfig
from s3djax.skip_plan import SkipPlan

PAPER_U = 0.01       # Eq. 10's U in the paper's Appendix E
PAPER_DELTA = 0.04   # Eq. 12's per-iteration overhead, in full forwards
PAPER_SLOPE = 0.25   # Eq. 14: alpha_k = (1 - (k-1)/4) * alpha_1


# ---------------------------------------------------------------- skip schemes and beta

def skip_schemes(num_layers: int, num_skipped: int) -> dict[str, SkipPlan]:
    """The paper's four families at one beta: the same number of whole layers skipped, in different places.

    symmetric middle: S3D's choice; early exit: the top layers go (the draft exits early);
    late only: the bottom layers go (the draft starts late); alternating: skips spread evenly.
    """
    n, L = num_skipped, num_layers
    spread = sorted({int((i + 0.5) * L / n) for i in range(n)}) if n else []
    return {"symmetric middle": SkipPlan.symmetric_middle(L, n),
            "early exit": SkipPlan.skipping_layers(L, range(L - n, L)),
            "late only": SkipPlan.skipping_layers(L, range(n)),
            "alternating": SkipPlan.skipping_layers(L, spread)}


def shipped_plan(model: str, num_layers: int) -> SkipPlan:
    """The skip plan a model's shipped S3D draft was trained with, and so the one it must run."""
    from s3djax import registry
    from s3djax.speculative.draft_params import load_artifact

    return SkipPlan.parse(load_artifact(registry.entries()[model].draft_path("s3d"), np.float32)[1]["skip"], num_layers)


def window(num_layers: int, num_skipped: int, start: int) -> SkipPlan:
    """A run of skipped layers starting at `start`: sliding it from the bottom to the top walks from
    late-only through symmetric-middle to early-exit, as the x-axis of the paper's Fig. 4 does."""
    return SkipPlan.skipping_layers(num_layers, range(start, start + num_skipped))


def beta(plan: SkipPlan | None, config: ModelConfig) -> float:
    """Fraction of the decoder layers' parameters the plan runs (embedding and head excluded, as the
    paper counts layers: 12 of 32 LLaMA layers is its beta = 0.375). Sub-layer plans weigh attention
    and MLP by their parameter counts."""
    if plan is None:
        return 1.0
    c = config
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    kept = sum(a * attn + m * mlp for a, m in zip(plan.attn, plan.mlp))
    return kept / (plan.num_layers * (attn + mlp))


# ---------------------------------------------------------------- the paper's speed model

def alpha_of_beta(b, u: float = PAPER_U):
    """Eq. 10: first-draft acceptance of a draft running a fraction beta of the target. alpha(0) = 0,
    alpha(1) = 1; U < 1 bends it above the diagonal (a half-model accepts most drafts), U = 1 is the
    diagonal itself (its limit), U > 1 bends it below."""
    b = np.asarray(b, float)
    if abs(u - 1.0) < 1e-9:
        return b
    return (1.0 - u ** b) / (1.0 - u)


def discounted(alpha1, gamma: int, slope: float = PAPER_SLOPE) -> np.ndarray:
    """Eq. 14: alpha_k = (1 - slope * (k-1)) * alpha_1 for k = 1..gamma, floored at 0. The paper fitted
    slope = 1/4 to its own Fig. 10; `fit_slope` fits it here."""
    k = np.arange(gamma)
    return np.clip(1.0 - slope * k, 0.0, None) * np.asarray(alpha1, float)


def tau_of_alphas(alphas) -> float:
    """Eq. 11 for a chain of len(alphas) drafts: sum over n of n * P(exactly n-1 drafts accepted), with
    conditional alpha_k; the last term (all gamma accepted) has z = 1."""
    alphas = np.asarray(alphas, float)
    reach = np.concatenate([[1.0], np.cumprod(alphas)])     # reach[n]: P(at least n accepted)
    z = np.append(1.0 - alphas, 1.0)                        # z[n]: the chain stops after n accepted
    return float(np.sum(np.arange(1, len(reach) + 1) * reach * z))


def tau_model(gamma: int, b, u: float = PAPER_U, slope: float = PAPER_SLOPE) -> np.ndarray:
    """tau(gamma, beta): Eq. 11 over Eq. 14's discount of Eq. 10's alpha_1."""
    return np.vectorize(lambda x: tau_of_alphas(discounted(alpha_of_beta(x, u), gamma, slope)))(b)


def improvement_factor(tau, b, delta: float = PAPER_DELTA):
    """Eq. 12: tokens per unit time relative to AR, if a full forward costs C whatever its token count,
    a draft forward beta*C and each iteration delta*C more."""
    return np.asarray(tau, float) / (delta + np.asarray(b, float) + 1.0)


def fit_u(betas, alpha1s) -> float:
    """Least-squares U of Eq. 10 against measured (beta, alpha_1): a dense grid in log U, then golden
    section around its best point (one parameter; no optimiser dependency)."""
    betas, alpha1s = np.asarray(betas, float), np.asarray(alpha1s, float)

    def loss(log_u):
        return float(np.sum((alpha_of_beta(betas, float(np.exp(log_u))) - alpha1s) ** 2))

    grid = np.linspace(np.log(1e-12), np.log(1e4), 4001)
    i = int(np.argmin([loss(g) for g in grid]))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    golden = (np.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return float(np.exp((lo + hi) / 2))


def fit_slope(alpha_rows, min_alpha1: float = 0.05) -> float:
    """Least-squares slope s of Eq. 14 (alpha_k / alpha_1 = 1 - s (k-1)) over rows of measured alpha_k.
    Rows whose alpha_1 is below `min_alpha1` say nothing about decay (their ratios are noise) and
    are left out."""
    ks, ratios = [], []
    for row in alpha_rows:
        row = np.asarray(row, float)
        if len(row) > 1 and row[0] >= min_alpha1:
            ks.append(np.arange(1, len(row)))
            ratios.append(row[1:] / row[0])
    if not ks:
        return PAPER_SLOPE
    k, r = np.concatenate(ks), np.concatenate(ratios)
    return float(np.sum((1.0 - r) * k) / np.sum(k * k))


def fit_delta(betas, taus, speedups) -> float:
    """Least-squares delta of Eq. 12 from measured speedups. The model says one iteration costs
    tau / speedup = delta + beta + 1 AR steps, which is linear in delta, so the fit is the mean
    excess of the measured cost over beta + 1."""
    cost = np.asarray(taus, float) / np.asarray(speedups, float)
    return float(np.mean(cost - np.asarray(betas, float) - 1.0))


# ---------------------------------------------------------------- step times -> tokens/s

def iteration_cost(step_ms: dict) -> float:
    """One draft + verify iteration in AR steps: what Eq. 12 models as delta + beta + 1."""
    return (step_ms["draft_step_ms"] + step_ms["verify_step_ms"]) / step_ms["ar_step_ms"]


def predicted_tokens_per_s(tau, step_ms: dict):
    """tau tokens per iteration at the measured draft + verify time (the loop's own bookkeeping left out)."""
    return 1000.0 * np.asarray(tau, float) / (step_ms["draft_step_ms"] + step_ms["verify_step_ms"])


def ar_tokens_per_s(step_ms: dict) -> float:
    """The AR baseline the same step timings imply, so both sides of a speedup come from one clock."""
    return 1000.0 / step_ms["ar_step_ms"]


# ---------------------------------------------------------------- measurement

@dataclasses.dataclass
class Measurement:
    label: str
    method: str            # "ar" or "s3d"
    skip: str              # the draft's skip plan, as a spec string
    beta: float
    gamma: int
    tree: str
    draft: str             # which draft (the build's description)
    alpha: list[float]     # alpha_k, k = 1..tree depth, pooled over every verify step of every prompt
    tau: float
    verify_steps: int
    tokens: int            # new tokens after the first, over all prompts
    decode_s: float
    prompts: int
    step_ms: dict | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    def row(self) -> dict:
        """A flat dict for a table (pandas or markdown)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("alpha", "step_ms", "draft")}
        out.update({f"alpha_{k + 1}": a for k, a in enumerate(self.alpha)}, tokens_per_s=self.tokens_per_s)
        return out | (self.step_ms or {})


def fitting(prompts: list[dict], max_cache_len: int, max_new_tokens: int) -> list[dict]:
    """Prompts whose ids leave room for the whole budget, so no prompt is cut short by the cache."""
    return [p for p in prompts if len(p["ids"]) + max_new_tokens <= max_cache_len]


def measure_sets(gen, prompt_sets: dict[str, list[dict]], *, method: str = "s3d", gamma: int = 4,
                 tree: str = "chain", skip: SkipPlan | str | None = None, draft_path: str | None = None,
                 max_new_tokens: int = 64, step_times: bool = False, step_repeats: int = 3,
                 label: str = "") -> dict[str, Measurement]:
    """Decode every prompt of every set greedily with one decoder (compiled once) of the
    `s3djax.Generator` `gen`, and pool alpha_k and tau over each set's verify steps.

    `draft_path`: None takes the model's shipped draft, "none" the untrained mask token; a trained
    draft's adapters exist only on the layers its plan keeps, so another skip plan needs "none".
    `step_times` also times the AR, draft and verify steps apart on the first prompt's cache (the
    same numbers go with every set). Compile time is excluded from tokens/s: the Runner compiles
    ahead of time.
    """
    spec = skip.spec() if isinstance(skip, SkipPlan) else (skip or "")
    # The decay probed is the mask tokens': prompt lookup (the CPU's default) would draft some of the steps.
    lookup = {"lookup": 0} if method == "s3d" else {}
    session = gen.session(method, gamma=gamma, tree=tree, skip=spec, draft_path=draft_path, **lookup)
    built, runner = session.built, session.runner
    step_ms = None
    if step_times and method != "ar":
        from s3djax.speculative.profile import step_times as profile

        first = next(iter(prompt_sets.values()))[0]["ids"]
        step_ms = profile(built.decoder, built.params, runner.prefill(first), repeats=step_repeats)
    return {name: _pooled(gen.config, built, [runner.generate(p["ids"], max_new_tokens) for p in prompts],
                          method=method, gamma=gamma, tree=tree, label=label, step_ms=step_ms)
            for name, prompts in prompt_sets.items()}


def measure(gen, prompts: list[dict], **kwargs) -> Measurement:
    """`measure_sets` for one prompt set."""
    return measure_sets(gen, {"": prompts}, **kwargs)[""]


def _pooled(config, built, results, *, method, gamma, tree, label, step_ms) -> Measurement:
    from s3djax.speculative.loop import acceptance

    tokens, decode_s = sum(len(r.tokens) - 1 for r in results), sum(r.decode_s for r in results)
    if method == "ar":
        return Measurement(label or "ar", "ar", skip="", beta=1.0, gamma=0, tree="", draft="", alpha=[], tau=1.0,
                           verify_steps=tokens, tokens=tokens, decode_s=decode_s, prompts=len(results))
    drafter = built.decoder.drafter
    pooled = acceptance(np.concatenate([r.stats["accepted_per_step"] for r in results]), drafter.tree.depth)
    return Measurement(label or f"{tree}, skip {drafter.plan.spec()}", "s3d", drafter.plan.spec(),
                       beta(drafter.plan, config), gamma, tree, built.draft, pooled["acceptance_by_depth"],
                       pooled["mean_accepted_tokens"], pooled["verify_steps"], tokens, decode_s, len(results), step_ms)
