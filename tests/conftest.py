import os
import warnings

# One persistent XLA cache for every worker of a run and the command lines they start, set before JAX
# starts (subprocesses inherit it): tests build the same decoders again (each Runner lowers its own),
# and XLA's compiling is much of the suite's time on two cores.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
# Tests check what is computed, not how fast: XLA's backend optimizations cost a fifth of a SmolLM2
# decoder's compile-and-run here (58 s against 74 s for three prompts of ar and s3d, cold cache), and
# the suite is mostly compiling. `make generate` and the benchmarks compile fully optimized.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Every speculative step drafts unless a test sets the pause gate itself (tests/test_gate.py measures it as a user's
# first run with S3DJAX_TUNE=on does), whatever the environment running the suite says.
os.environ["S3DJAX_TUNE"] = "off"
# Defaults from configs/defaults.yaml, not timed on the machine running the suite (tests/test_defaults.py sets
# its own), so every test builds the same decoders wherever it runs.
os.environ["S3DJAX_DEFAULTS"] = "fixed"

import pytest  # noqa: E402
from jax import monitoring  # noqa: E402

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

# The modules `make test-quick` leaves out (pytest -m "not slow"): each runs whole decoders of SmolLM2, trains,
# samples thousands of times for a chi-square test, or compiles for a GPU. `make test`, CI's command, runs them all.
SLOW_MODULES = {"test_benchmark", "test_chat", "test_cpu_matmul", "test_distill", "test_gate", "test_generator", "test_gpu_suite",
                "test_h100_compile", "test_kangaroo", "test_long_prompt", "test_lookup", "test_lossless_sampling", "test_notebook",
                "test_objective", "test_optimized_compile", "test_parity_hf", "test_peers", "test_prepare_data",
                "test_s2d", "test_search_skip", "test_self_spec", "test_smollm2", "test_spec", "test_train"}


# Started first, so that the workers finish together: the longest tests (minutes on CI's 2 cores), which when handed
# out late run on while the other workers have nothing left.
FIRST = ("test_gpu_suite.py::test_tiny_runs_every_piece", "test_optimized_compile.py::", "test_long_prompt.py::",
         "test_notebook.py::")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: not any(name in item.nodeid for name in FIRST))  # stable: the rest keep their order

_COMPILES = []
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration"
    else None)


@pytest.fixture
def compiles():
    """How many executables were needed so far (compiled, or read from the persistent cache: JAX times
    both as a backend compile): a test compares it before and after."""
    return lambda: len(_COMPILES)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M-Instruct, loaded once for the whole session (fp32)."""
    from s3djax.loading import load_model

    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' own reading of the same GGUF: an independent check of our loader and forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from s3djax import registry

    path = registry.lookup("smollm2-135m").path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()
