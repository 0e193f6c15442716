"""A tiny random Llama over SmolLM2's vocabulary, so training tests run on real ShareGPT tokens in seconds."""

import jax

from s3djax import model
from s3djax.config import ModelConfig
from s3djax.loading import LoadedModel

TINY = ModelConfig(arch="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10000.0)


def tiny_model() -> LoadedModel:
    # Scaled up from init's 0.02 so that logits are far from uniform and there is something to distil.
    params = jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.init_params(TINY, jax.random.key(0)))
    return LoadedModel("tiny", TINY, params, None, 0.0)


def tiny_config(data: str, out: str, **overrides):
    from train.config import TrainConfig

    settings = dict(model="tiny", data=data, out=out, skip="1-2", gamma=3, lora_rank=4, steps=8, batch_size=4,
                    lr=1e-2, warmup_steps=2, target="kl", compute_dtype="float32", log_every=1, eval_every=4, eval_batches=2,
                    save_every=2, anchor_fraction=0.1)
    return TrainConfig(**{**settings, **overrides})
