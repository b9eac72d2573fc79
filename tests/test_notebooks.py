"""The teaching notebooks (notebooks/) run top to bottom on the demo model, as a reader runs them, and are
kept in the repository without outputs. A notebook's own asserts (a shifted cache's logits against a fresh
run, a slot search that must fail, ...) fail this test when the engine stops behaving as its prose says."""
from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 7, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_stripped_and_valid(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    assert "widgets" not in notebook.metadata, "widget state is stored: strip it (a plotly widget is megabytes)"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"outputs stored in {path.name}: {cell.source[:60]!r}"
    headings = [line for cell in notebook.cells if cell.cell_type == "markdown" for line in cell.source.splitlines()
                if line.startswith("#")]
    assert any("Exercises" in line for line in headings), f"{path.name} has no Exercises section"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.monotonic()
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    print(f"{path.name}: {time.monotonic() - t0:.1f} s")
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
