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
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"cpu_kernels: built {LIBRARY.relative_to(HERE.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
