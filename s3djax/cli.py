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
        """The speculative methods' flags (`s3djax.options`); `several`: one run builds several methods."""
        from s3djax import options

        options.add_flags(self, several)

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
