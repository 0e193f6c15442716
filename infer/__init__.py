"""Command-line tools: `python -m infer.generate` (and, later, `infer.benchmark`)."""
