"""examples/notebooks/finetune.ipynb runs headless, top to bottom, on a tiny slice."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB = os.path.join(ROOT, "examples", "notebooks", "finetune.ipynb")


def test_finetune_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat comes with nbclient (make setup installs it)")
    from nbclient import NotebookClient

    monkeypatch.setenv("PU_NB_TRAIN", "64")
    monkeypatch.setenv("PU_NB_DEV", "32")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    nb = nbformat.read(NB, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "speedup:" in outputs and "paddle_unpad" in outputs
    # 64 snippets = 2 batches, well inside the time budget: both ways train both batches
    assert "both ways trained the same 2 batches" in outputs, outputs
    assert (tmp_path / "finetune_throughput.png").stat().st_size > 1000
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
