"""`python -m infer.quantize`: write a model's int8 weights as a checkpoint folder that --model loads.

    python -m infer.quantize --model smollm2-135m --quant int8 --out models/smollm2-135m-int8
    python -m infer.generate --model models/smollm2-135m-int8 --method s3d --prompt "..."

The folder holds config.json (with a `quantization_config`), model.safetensors (int8 `.weight`
and fp32 `.weight_scale` per linear) and the tokenizer.
"""

from __future__ import annotations

import sys

from s3djax.cli import Parser, output_folder, run


def main(argv=None):
    p = Parser(prog="python -m infer.quantize", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name, .gguf file or checkpoint folder")
    p.add_argument("--checkpoint", help="checkpoint folder for a registry shape such as llama-2-7b")
    p.add_argument("--quant", choices=("int8", "int8-all"), default="int8")
    p.add_argument("--out", required=True, help="the folder to write")
    args = p.parse_args(argv)

    from s3djax import quant, weights
    from s3djax.loading import open_model

    source = open_model(args.model, args.checkpoint)
    output_folder(args.out)
    m = source.load(quantization=args.quant)
    weights.save_hf_folder(args.out, m.config, m.params, m.tokenizer)
    print(f"wrote {args.out}: {m.name}, {args.quant}, {quant.param_bytes(m.params) / 2**20:.0f} MiB of parameters",
          file=sys.stderr)


if __name__ == "__main__":
    run(main)
