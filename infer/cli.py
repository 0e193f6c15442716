"""What every command-line tool shares: one-line errors with exit code 2, quiet JAX start-up."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from s3djax.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2, without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def add_sampling(self):
        self.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
        self.add_argument("--top-k", type=int, default=0)
        self.add_argument("--top-p", type=float, default=1.0)
        self.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")

    def check(self, args, **valid):
        """`--flag-name: invalid value` for each flag_name=False, sampling flags included when defined."""
        if hasattr(args, "temperature"):
            valid = dict(temperature=args.temperature >= 0, top_k=args.top_k >= 0, top_p=0 < args.top_p <= 1, **valid)
        for name, ok in valid.items():
            if not ok:
                self.error(f"argument --{name.replace('_', '-')}: invalid value {getattr(args, name)}")


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
