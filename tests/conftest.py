import os
import warnings

import pytest
from jax import monitoring

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

_COMPILES = []
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration"
    else None)


@pytest.fixture
def compiles():
    """How many XLA backend compilations have run so far: a test compares it before and after."""
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
