"""The teaching notebooks (notebooks/) run top to bottom on the demo model, as a reader runs them, and are
kept in the repository without outputs. A notebook's own asserts (a shifted cache's logits against a fresh
run, a slot search that must fail, ...) fail this test when the engine stops behaving as its prose says. A
notebook leaves the reader's folder as it found it, and asserts nothing a busy machine's clock decides."""
from __future__ import annotations

import re
import time
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 8, [p.name for p in NOTEBOOKS]


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


VISIBLE_LINES = 10  # a visible code cell's most lines (blank ones aside): the idea, not its plumbing


def hidden(cell) -> bool:
    """A cell JupyterLab shows collapsed (plumbing a reader may open, but need not read)."""
    return bool(cell.metadata.get("jupyter", {}).get("source_hidden"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_newcomer_reads_short_cells_and_checkable_exercises(path: Path) -> None:
    """Visible code cells are a few lines: checks and plumbing live in kvscope.lessons or in collapsed cells.
    The exercises can be checked (lessons.check), and a cell that only sets things up is not most of them."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    long = [cell.source.splitlines()[0] for cell in code if not hidden(cell)
            and sum(1 for line in cell.source.splitlines() if line.strip()) > VISIBLE_LINES]
    assert not long, f"{path.name}: visible code cells longer than {VISIBLE_LINES} lines, starting {long}"
    assert any("from kvscope import lessons" in cell.source for cell in code), f"{path.name} does not use kvscope.lessons"
    exercises = next(k for k, cell in enumerate(notebook.cells)
                     if cell.cell_type == "markdown" and "# Exercises" in cell.source)
    assert any("lessons.check(" in cell.source for cell in notebook.cells[exercises:] if cell.cell_type == "code"), \
        f"{path.name}: no exercise a reader can check (lessons.check)"


# What a reader must never be left to decode: Python's own reprs of the engine's records.
RAW_REPRS = re.compile(r"frozenset\(|np\.(int|float)\d*\(|array\(\[|<engine\.|\bStreamCells\(|\bCellsChanged\(")


def said(output) -> bool:
    """An output that puts what was seen into words: lessons.say / picture / check (Markdown or HTML)."""
    data = output.get("data", {})
    return any(kind in data for kind in ("text/markdown", "text/html", "image/png"))


def check_outputs_are_explained(path: Path, notebook: nbformat.NotebookNode) -> None:
    """Every output is followed by words: the cell says what it showed (lessons.say), or the next cell is prose."""
    cells = notebook.cells
    bare = []
    for k, cell in enumerate(cells):
        if cell.cell_type != "code" or not cell.outputs:
            continue
        for output in cell.outputs:
            text = output.get("text", "") or "".join(str(v) for key, v in output.get("data", {}).items()
                                                      if key == "text/plain")
            assert not RAW_REPRS.search(text), f"{path.name}: a raw repr in the output of {cell.source[:60]!r}: {text[:200]!r}"
        next_is_prose = k + 1 < len(cells) and cells[k + 1].cell_type == "markdown"
        if not (said(cell.outputs[-1]) or next_is_prose):
            bare.append(cell.source.splitlines()[0])
    assert not bare, f"{path.name}: outputs with no words after them (end the cell with lessons.say): {bare}"


def execute(notebook: nbformat.NotebookNode, folder: Path) -> None:
    """Run every cell in a fresh kernel whose working folder is `folder`, as a reader's JupyterLab does."""
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    client.execute()  # raises CellExecutionError naming the cell and the traceback


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    t0 = time.monotonic()
    execute(notebook, tmp_path)
    print(f"{path.name}: {time.monotonic() - t0:.1f} s")
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    check_outputs_are_explained(path, notebook)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert not written, f"{path.name} wrote {written} into the folder it runs in: write into a temporary folder"


# Every interval that code in the notebook times (functions its cells define included, and its lesson module in
# kvscope.lessons) lasts exactly 1 ms; the engine's own timing, which reads the clock from its modules, keeps the
# real one.
EQUAL_CLOCK = """\
import sys, time
_clock_reads = [0]
def _equal_clock(real, reads=_clock_reads, frame=sys._getframe):  # no globals: the engine reads it at exit too
    def clock():
        caller = frame(1).f_globals.get("__name__") or ""
        if caller != "__main__" and not caller.startswith("kvscope.lessons"):
            return real()
        reads[0] += 1
        return reads[0] * 1e-3
    return clock
time.perf_counter, time.monotonic, time.time = (_equal_clock(f) for f in (time.perf_counter, time.monotonic, time.time))
"""
CLOCK_READS = re.compile(r"\btime\.(perf_counter|monotonic|time)\(")
LESSONS = Path(__file__).resolve().parent.parent / "kvscope" / "lessons"
LESSON_MODULE = re.compile(r"kvscope\.lessons\.(\w+)|from kvscope\.lessons import ([\w, ]+)|\blessons\.(\w+)\.")


def times_something(notebook: Path) -> bool:
    """The notebook reads the clock, itself or through a lesson module it uses."""
    text = notebook.read_text(encoding="utf-8")
    names = {name.strip() for match in LESSON_MODULE.findall(text) for group in match for name in group.split(",")}
    modules = [LESSONS / f"{name}.py" for name in names if name and (LESSONS / f"{name}.py").exists()]
    return any(CLOCK_READS.search(source) for source in [text, *(m.read_text(encoding="utf-8") for m in modules)])


TIMING_NOTEBOOKS = [p for p in NOTEBOOKS if times_something(p)]


def test_the_clock_check_finds_the_notebooks_that_time() -> None:
    assert "01-what-a-kv-cache-is" in [p.stem for p in TIMING_NOTEBOOKS]


@pytest.mark.parametrize("path", TIMING_NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_asserts_nothing_about_the_clock(path: Path, tmp_path: Path) -> None:
    """On a shared machine any step can stall (a notebook once failed one run in four on `with the cache <
    without` in seconds). What a notebook asserts must hold whatever the clock says: here every interval it
    times is the same, so a cached step is as slow as a recomputed one and a prefill as slow as a decode."""
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(EQUAL_CLOCK))
    notebook.cells.append(nbformat.v4.new_code_cell("assert _clock_reads[0] > 100, _clock_reads  # it timed under this clock"))
    execute(notebook, tmp_path)
