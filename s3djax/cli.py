"""What every command-line tool shares (infer/, train/, benchmarks/): one argument parser with
one-line errors and exit code 2, the sampling and method flags, the output folder made before any
weight is read, and a quiet JAX start-up."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from s3djax import progress
from s3djax.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2, without the usage block; and
    every tool takes --progress."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--progress", action="store_true", help="draw progress bars even when stderr is not a terminal")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        progress.FORCE = parsed.progress
        return parsed

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def add_sampling(self):
        self.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        self.add_argument("--top-k", type=int, default=0)
        self.add_argument("--top-p", type=float, default=1.0)
        self.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")

    def add_method_options(self, several: bool = False):
        """The speculative methods' flags; `several`: one run builds several methods (infer.benchmark)."""
        self.add_argument("--skip", default="", help='layers to skip, e.g. "8-21" or "3.attn,5-7.mlp": the draft\'s '
                          "plan for s3d (default: about half, around the middle) and self-spec (default: its "
                          "searched plan), the whole model's for ar (default: none)")
        artifact = ("the method's trained artifact: s3d's draft (.npz), self-spec's searched plan (.yaml), kangaroo's "
                    "adapter or s2d's nested draft (.npz); default: the model's shipped one; 'none': untrained "
                    "(s3d's bare mask token, self-spec's default plan)")
        self.add_argument("--draft", "--skip-plan", dest="draft", help=artifact + (
            "; with several methods, METHOD=PATH pairs separated by commas" if several else ""))
        self.add_argument("--gamma", type=int, help="positions drafted per step (s3d; default: a named tree's "
                          "depth, else the platform's measured fastest: 4 on a CPU whose kernels run AVX-512, else 2 "
                          "on a CPU, the paper's 4 elsewhere)")
        self.add_argument("--max-draft", type=int, help="the deepest draft of self-spec, kangaroo and s2d "
                          "(default: the one their file records as measured fastest, else the paper's: 12 for "
                          "self-spec, 6 for the others), and lookup (default: 4 on a CPU whose kernels run AVX-512, "
                          "else 2)")
        self.add_argument("--tree", help="token tree: chain, topK (the chain plus the next K-1 "
                          "candidates at each depth; default: the one the draft's file records as measured fastest, "
                          "else chain), dynamic-N (s3d: the N likeliest paths by the draft's joint "
                          "probabilities, chosen every step), or a name in configs/trees (s3d)")
        self.add_argument("--exit-layer", type=int, help="kangaroo: the early-exit layer (default: the adapter's)")
        self.add_argument("--eta", type=float, help="kangaroo: stop drafting at top-1 confidence <= eta (default: "
                          "the adapter's measured choice, else the paper's 0.6)")
        self.add_argument("--thresholds", help="s2d: per-exit confidence thresholds a,b,c (default: the draft's "
                          "for this target)")
        self.add_argument("--target-from", help="s2d: verify with this full-mode s3d draft's fine-tuned layers")
        self.add_argument("--ngram", type=int, help="lookup: the longest n-gram of the last tokens matched in the "
                          "prompt and output (down to 1; default 3)")
        self.add_argument("--lookup", type=int, help="s3d, self-spec, kangaroo and s2d on a chain: draft a step's "
                          "chain by prompt lookup instead, wherever the last N or more tokens occurred before "
                          "(0: never; default: the measured fastest, 1 on a CPU, for s3d 2 on an AVX-512 CPU, else 0)")
        self.add_argument("--in-verify", choices=("on", "off"), help="s3d on a chain: on drafts the next chain "
                          "inside the verify pass, a draft block beside every drafted token, instead of in a draft "
                          "step (default: the measured fastest, off)")
        self.add_argument("--draft-weights", help="s3d, self-spec, kangaroo and s2d: the weights their draft reads, none "
                          "(the target's) or int8 (int8 copies of the layers it runs alone, its head rows and "
                          "adapter; verification keeps the target's, so the output is the same); default: the "
                          "platform's measured fastest, int8 on a CPU, else none")

    def check(self, args, **valid):
        """`--flag-name: invalid value` for each flag_name=False. Sampling and method options are the
        library's to check (`Sampling`, `methods.check`), so the Python API gives the same errors."""
        for name, ok in valid.items():
            if not ok:
                self.error(f"argument --{name.replace('_', '-')}: invalid value {getattr(args, name)}")


def output_folder(path: str, flag: str = "--out") -> str:
    """Create the output folder now, before any weight is read, so an unwritable one fails at once."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {flag} {path}: {e.strerror}") from None
    return path


def sampling(args):
    from s3djax.sampling import Sampling

    return Sampling(args.temperature, args.top_k, args.top_p)


def run(main) -> None:
    """Call `main()`; turn UserError into one line and exit code 2."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # CPU XLA cannot reuse donated buffers and says so once per executable; it changes nothing.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
