"""Inference command lines: `python -m infer.generate` (one prompt, streamed, with a stats line),
`infer.benchmark` (methods and peers against `ar` on MT-Bench, HumanEval and held-out ShareGPT) and
`infer.quantize` (an int8 checkpoint folder); `peers` and `llamacpp` are the benchmark's transformers
and llama.cpp baselines on the same weights."""
