"""s3djax: self-speculative decoding (S3D and its family) for Llama and Phi-3 in JAX.

    import s3djax
    gen = s3djax.Generator("smollm2-135m", method="s3d")
    out = gen.generate("Explain why the sky is blue.", max_new_tokens=128)
    print(out.text, out.tokens_per_s, out.tau)

The public names: `Generator` (a model loaded once; `generate`, `stream` and `session` with any
method), `Sampling` (temperature, top-k and top-p, passed whole), `Output` (one completion and its statistics),
`Stream` (text as it is decoded), `Session` (one built method and its compiled steps), `Chat` (a conversation
continuing one cache, from `Generator.chat`) and `UserError` (bad input, with a one-line message).
They load on first use, so `import s3djax` alone does not import JAX. The modules below them are
the engine: the model (`config`, `layers`, `model`, `cache`, `quant`), loading (`loading`,
`registry`, `weights`, `tokenizer`), decoding (`decode`, `methods`, `speculative`), and what the
command lines, benchmarks and notebook share (`cli`, `bench_data`, `sharegpt`, `analysis`).
"""

__all__ = ["Chat", "Generator", "Output", "Sampling", "Session", "Stream", "UserError"]


def __getattr__(name):
    if name == "UserError":
        from s3djax.errors import UserError

        return UserError
    if name == "Sampling":
        from s3djax.sampling import Sampling

        return Sampling
    if name in __all__:
        from s3djax import generator

        return getattr(generator, name)
    raise AttributeError(f"module 's3djax' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
