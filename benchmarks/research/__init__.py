"""Probes that explain a figure (what a forward over T tokens costs, what sampling adds, what the training metric
predicts): research tools, not the benchmarks a user runs (those are `infer.benchmark` and `benchmarks/`)."""
