"""Small random models for tests: Llama and Phi-3 shapes, and a tiny Llama over SmolLM2's vocabulary so
training tests run on real ShareGPT tokens in seconds. That one is also written as a checkpoint folder with
SmolLM2's tokenizer, so every command that takes --model runs on it in seconds (the GPU suite's --tiny mode):

    python -m tests.tiny --out DIR
"""

from s3djax.cli import Parser, output_folder, run
from s3djax.config import ModelConfig
from s3djax.loading import LoadedModel

TINY = ModelConfig(arch="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10000.0)

LLAMA = ModelConfig(arch="llama", vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=12, rope_theta=500.0)
PHI3 = ModelConfig(arch="phi3", vocab_size=89, hidden_size=40, intermediate_size=72, num_layers=4, num_heads=5,
                   num_kv_heads=1, head_dim=8, rope_theta=700.0)


def random_correction(config: ModelConfig, seed: int, rank: int = 4) -> dict:
    """A random, non-zero previous-token correction for a draft of this model."""
    import jax

    from s3djax.speculative.correction import init_correction

    c = init_correction(config.hidden_size, rank, jax.random.key(seed))
    out = jax.random.normal(jax.random.key(seed + 1), c["out"].shape)
    return {**c, "token": 10 * c["token"], "out": out}  # loud enough that the previous token changes choices


def random_params(config: ModelConfig, seed: int) -> dict:
    # Scaled up from init's 0.02 so that argmaxes depend on the weights (a flat model repeats one
    # token) and a draft has something to distil.
    import jax

    from s3djax import model

    return jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.init_params(config, jax.random.key(seed)))


def tiny_model(seed: int = 0) -> LoadedModel:
    return LoadedModel("tiny", TINY, random_params(TINY, seed), None, 0.0)


def tiny_config(data: str, out: str, **overrides):
    from train.config import TrainConfig

    settings = dict(model="tiny", data=data, out=out, skip="1-2", gamma=3, lora_rank=4, steps=8, batch_size=4,
                    lr=1e-2, warmup_steps=2, target="kl", compute_dtype="float32", log_every=1, eval_every=4, eval_batches=2,
                    save_every=2, anchor_fraction=0.1)
    return TrainConfig(**{**settings, **overrides})


def write_folder(folder: str, tokenizer, seed: int = 0) -> str:
    from s3djax import weights

    weights.save_hf_folder(folder, TINY, random_params(TINY, seed), tokenizer)
    return folder


def main(argv=None):
    p = Parser(prog="python -m tests.tiny", description="A tiny random Llama over SmolLM2's vocabulary, written as a "
               "checkpoint folder with SmolLM2's tokenizer.")
    p.add_argument("--out", required=True, help="the checkpoint folder to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from s3djax.loading import load_tokenizer

    write_folder(output_folder(args.out), load_tokenizer("smollm2-135m"), args.seed)


if __name__ == "__main__":
    run(main)
