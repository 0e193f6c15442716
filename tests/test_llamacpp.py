"""The llama.cpp peers' probe: a peer that crashes its process is found in a child first, named in one line."""

import signal
import subprocess
import sys

import pytest

from infer import llamacpp
from s3djax import registry


REAL_RUN = subprocess.run


def crashing(signum):
    """`subprocess.run` with its command swapped for a Python child that dies by `signum`, as llama.cpp's library
    does on some hosts."""
    def run(command, **kw):
        return REAL_RUN([sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(signum)})"], **kw)
    return run


def test_a_peer_that_crashes_in_its_probe_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: None)
    for signum in (signal.SIGSEGV, signal.SIGILL):
        monkeypatch.setattr(llamacpp.subprocess, "run", crashing(signum))
        why = llamacpp.fails("llamacpp-q8_0", "model.gguf")
        assert why and signum.name in why and "llamacpp-q8_0" in why and "\n" not in why


def test_a_peer_that_cannot_start_says_why_without_a_child(monkeypatch):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: "llama.cpp peers need llama-cpp-python")
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **kw: pytest.fail("a child ran"))
    assert llamacpp.fails("llamacpp-f32", "model.gguf") == "llama.cpp peers need llama-cpp-python"


def test_the_probe_of_an_unknown_peer_fails_in_its_own_one_line_error(monkeypatch):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: None)
    assert llamacpp.fails("llamacpp-q2", "model.gguf") == \
        f"error: unknown llama.cpp peer 'llamacpp-q2'; choose from {', '.join(llamacpp.PEERS)}"


def test_the_f32_peer_passes_its_probe_where_llama_cpp_is_installed():
    pytest.importorskip("llama_cpp")
    assert llamacpp.fails("llamacpp-f32", registry.lookup("smollm2-135m").path()) is None
