"""`-p tests.compile_profile`: each test's compiles recorded where it ran, and `python -m tests.compile_profile`'s
table of them."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_plugin_records_a_tests_compiles_and_the_table_shows_them(tmp_path):
    (tmp_path / "test_one.py").write_text("import jax\n\n\ndef test_adds():\n"
                                          "    assert float(jax.jit(lambda x: x * 2 + 1)(1.0)) == 3.0\n")
    env = dict(os.environ, S3DJAX_COMPILE_PROFILE=str(tmp_path / "profile"), JAX_ENABLE_COMPILATION_CACHE="false")

    def run(*argv):
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env)
    nothing = run("-m", "tests.compile_profile")
    assert nothing.returncode == 2 and nothing.stderr.startswith("error: no profile")
    assert nothing.stderr.count("\n") == 1
    ran = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.compile_profile",
              str(tmp_path / "test_one.py"))
    assert ran.returncode == 0, ran.stdout[-2000:]
    (row,) = json.loads((tmp_path / "profile" / "main.json").read_text())
    assert row["test"].endswith("test_one.py::test_adds") and row["executables"] >= 1
    assert 0 < row["compile_s"] <= row["wall_s"] and row["cache_hits"] == 0
    table = run("-m", "tests.compile_profile")
    assert table.returncode == 0 and table.stdout.startswith("1 tests; worker-seconds")
    assert "test_one.py::test_adds |" in table.stdout
