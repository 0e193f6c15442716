"""A tiny random Llama over SmolLM2's vocabulary, written as a checkpoint folder with SmolLM2's tokenizer:
every command that takes --model runs on it in seconds (the GPU suite's --tiny mode, the tests).

    python -m benchmarks.tiny_model --out DIR
"""

from __future__ import annotations

import jax

from s3djax.cli import Parser, output_folder, run
from s3djax import model
from s3djax.config import ModelConfig

TINY = ModelConfig(arch="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10000.0)


def random_params(config: ModelConfig, seed: int) -> dict:
    # Scaled up from init's 0.02 so that argmaxes depend on the weights (a flat model repeats one
    # token) and a draft has something to distil.
    return jax.tree.map(lambda a: a * 8 if a.ndim == 2 else a, model.init_params(config, jax.random.key(seed)))


def write_folder(folder: str, tokenizer, seed: int = 0) -> str:
    from s3djax import weights

    weights.save_hf_folder(folder, TINY, random_params(TINY, seed), tokenizer)
    return folder


def main(argv=None):
    p = Parser(prog="python -m benchmarks.tiny_model", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the checkpoint folder to write")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from s3djax.loading import load_tokenizer

    write_folder(output_folder(args.out), load_tokenizer("smollm2-135m"), args.seed)


if __name__ == "__main__":
    run(main)
