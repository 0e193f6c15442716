import os
import warnings

import pytest

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


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
