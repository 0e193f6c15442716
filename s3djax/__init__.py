"""s3djax: self-speculative decoding (S3D and its family) in JAX.

    import s3djax
    gen = s3djax.Generator("smollm2-135m", method="s3d")
    out = gen.generate("Explain why the sky is blue.", max_new_tokens=128)

The names load on first use, so `import s3djax` alone does not import JAX.
"""

__all__ = ["Generator", "Output", "Stream", "UserError"]


def __getattr__(name):
    if name == "UserError":
        from s3djax.errors import UserError

        return UserError
    if name in __all__:
        from s3djax import generator

        return getattr(generator, name)
    raise AttributeError(f"module 's3djax' has no attribute {name!r}")
