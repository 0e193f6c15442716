"""Build the CPU kernels' shared library with CMake, against the installed jax's FFI headers.

    python -m cpu_kernels.build      (run by `make setup`; rebuilt there when a source changes)
"""

from __future__ import annotations

import pathlib
import platform
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
BUILD = HERE / "build"
LIBRARY = BUILD / "libs3djax_cpu.so"


def main() -> int:
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"cpu_kernels: no kernel for {platform.machine()}; decoding uses XLA's dot", file=sys.stderr)
        return 0
    import jax.ffi

    configure = ["cmake", "-S", str(HERE), "-B", str(BUILD), f"-DJAX_FFI_INCLUDE_DIR={jax.ffi.include_dir()}"]
    for cmd in (configure, ["cmake", "--build", str(BUILD), "-j", "2"]):
        try:
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        except FileNotFoundError:
            done = None
        if done is None or done.returncode:
            why = f"{cmd[0]} is not installed" if done is None else \
                (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            # One line, and the set-up goes on: without the library, decoding uses XLA's dot (matmul.unavailable).
            print(f"cpu_kernels: not built ({' '.join(cmd[:2])}: {why}); decoding uses XLA's dot", file=sys.stderr)
            return 0
    print(f"cpu_kernels: built {LIBRARY.relative_to(HERE.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
