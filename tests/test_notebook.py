"""examples/notebooks/finetune.ipynb runs headless, top to bottom, on a tiny slice, and is
stored without paths of the machine that last ran it."""

import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB = os.path.join(ROOT, "examples", "notebooks", "finetune.ipynb")
# an absolute path of some machine (not part of a URL such as https://host/home/...)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|tmp|Users|usr|opt|mnt|var|srv)/")


def _text_of(nb):
    """Everything a reader sees of the notebook as text: sources, outputs, metadata (images'
    base64 data left out: it can spell anything)."""
    nb = json.loads(json.dumps(nb))
    for c in nb["cells"]:
        for o in c.get("outputs", []):
            for k in [k for k in o.get("data", {}) if k.startswith("image/")]:
                del o["data"][k]
    return json.dumps(nb, indent=1, ensure_ascii=False)


def test_committed_notebook_holds_no_machine_paths():
    with open(NB, encoding="utf-8") as f:
        text = _text_of(json.load(f))
    found = sorted({line.strip() for line in text.splitlines() if MACHINE_PATH.search(line)})
    assert not found, (
        "examples/notebooks/finetune.ipynb carries absolute paths (drop those outputs, e.g. "
        "stderr warnings from site-packages):\n" + "\n".join(found[:10])
    )


@pytest.mark.slow
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
