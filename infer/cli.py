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
