"""The research notebook runs top to bottom in its tiny setting (a random 4-layer model, one prompt a
set), in a kernel on this venv's interpreter. The saved outputs are a full run; this leaves them alone."""

import os
import pathlib
import sys

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_acceptance_decay_notebook_runs_in_the_tiny_setting(monkeypatch):
    nb = nbformat.read(ROOT / "notebooks" / "acceptance_decay.ipynb", as_version=4)
    # The kernel inherits this environment: the setting, and the repository on its path.
    monkeypatch.setenv("S3D_NOTEBOOK_SETTING", "tiny")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('kernel interpreter:', sys.executable)"))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "setting tiny" in printed and "device:" in printed
    assert f"kernel interpreter: {sys.executable}" in printed  # the venv's python, not some other one
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
