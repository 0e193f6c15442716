"""The speed model (the S3D paper's Eq. 10-12): what a chain depth gains, from what it commits and what it costs.

A speculative step at chain depth g commits tau(g) tokens on average and costs its draft and its verify of g + 1
rows; `ar` commits one token a step. So the method's speed against `ar` is

    speedup(g) = tau(g) * ar_s / (model_drafts(g) * draft_s(g) + verify_s(g))

where model_drafts(g) is the share of steps whose model draft ran (a chain that gives way to prompt lookup skips
it). tau and model_drafts come from decoding held-out prompts (`train.acceptance`); the step times from the machine
at hand (`s3djax.defaults`).
"""

from __future__ import annotations

# The methods whose chain depth the model chooses, and the option that depth is. Here, where nothing is imported, so
# that a command line can name them before it imports JAX.
DEPTH_OPTION = {"s3d": "gamma", "lookup": "max_draft", "self-spec": "max_draft", "kangaroo": "max_draft",
                "s2d": "max_draft"}


def step_s(costs: dict, g: int, model_drafts: float) -> float:
    """Seconds a step at depth g costs: costs = {"draft": {g: s}, "verify": {g: s}}."""
    return model_drafts * costs["draft"][g] + costs["verify"][g]


def speedups(record: dict, costs: dict) -> dict[int, float]:
    """{g: predicted speed against `ar`} for every depth both the record ({g: {tau, model_drafts}}) and the
    costs ({"ar": s, "draft": {g: s}, "verify": {g: s}}) hold."""
    return {g: r["tau"] * costs["ar"] / step_s(costs, g, r["model_drafts"])
            for g, r in sorted(record.items()) if g in costs["draft"] and g in costs["verify"]}


def comparison_error(costs: dict, g: int, h: int | None = None) -> float:
    """How far the measured ratio of depth g's step to depth h's (to `ar`'s where h is None) may be off, a share: the
    standard error of the median of that ratio round by round (costs["rounds"], {g: [each round's step against
    `ar`'s, None where not timed]}), from the median absolute deviation, so one stretch another process slowed does
    not widen it. 0 where fewer than two rounds timed both."""
    import statistics

    rounds = costs.get("rounds", {})
    mine = rounds.get(g, ())
    pairs = [a / b for a, b in zip(mine, rounds.get(h, ()) if h is not None else [1.0] * len(mine)) if a and b]
    if len(pairs) < 2:
        return 0.0
    m = statistics.median(pairs)
    return 1.2533 * 1.4826 * statistics.median(abs(x / m - 1) for x in pairs) / len(pairs) ** 0.5


def best_depth(record: dict, costs: dict) -> tuple[int, dict[int, float]]:
    """(the depth to run, every depth's predicted speedup): the shallowest whose prediction is within its comparison
    with the best's error (`comparison_error`) of the best. Where two depths are that close, which predicts faster
    is the timing's noise, and a deeper chain also stakes more on the record's acceptance holding for the user's
    prompts (its last drafts are the ones accepted least)."""
    predicted = speedups(record, costs)
    if not predicted:
        raise ValueError("no depth has both a record and a cost")
    top = max(predicted, key=predicted.get)
    return min(g for g, p in predicted.items()
               if p >= predicted[top] * (1 - comparison_error(costs, g, top))), predicted


# How far below the best a depth's prediction must fall to count as past it: step times spread by a few percent from
# run to run, and a flat curve (lookup's) must not stop at its first dip.
PAST_BEST = 0.95


def past_best(predicted: dict[int, float]) -> bool:
    """Whether the two deepest depths in `predicted` are both clearly slower than the best (below PAST_BEST of it):
    past them a chain commits little more and costs more, so deeper ones are not worth measuring."""
    deepest, best = sorted(predicted)[-2:], max(predicted.values(), default=0.0)
    return len(deepest) == 2 and all(predicted[g] < PAST_BEST * best for g in deepest)
