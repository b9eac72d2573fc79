"""tools/render_lessons.py: the rendered copies of the notebooks under docs/lessons/ keep only what reads without
a live kernel, link from where they are, and are current (every code cell of the notebook as it is now)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("render_lessons", ROOT / "tools" / "render_lessons.py")
render_lessons = importlib.util.module_from_spec(spec)
sys.modules["render_lessons"] = render_lessons
spec.loader.exec_module(render_lessons)


def test_links_are_rewritten_for_docs_lessons_and_notebooks_point_to_their_copies():
    text = ("[notebook 3](03-sequences-and-streams.ipynb), [the doc](../docs/how-the-kv-cache-works.md#cells), "
            "[llama.cpp](https://github.com/ggml-org/llama.cpp), [a section](#exercises)")
    moved = render_lessons.relink(text, render_lessons.NOTEBOOKS)
    assert "[notebook 3](03-sequences-and-streams.md)" in moved
    assert "[the doc](../how-the-kv-cache-works.md#cells)" in moved
    assert "(https://github.com/ggml-org/llama.cpp)" in moved and "(#exercises)" in moved


def test_only_live_outputs_are_dropped_and_an_error_stops_the_render():
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "a"},
                                                     "text/plain": "FigureWidget(...)"}),
        nbformat.v4.new_output("display_data", data={"application/vnd.plotly.v1+json": {}, "text/html": "<div>"}),
        nbformat.v4.new_output("display_data", data={"text/html": "<script>" + "x" * 30_000}),
        nbformat.v4.new_output("display_data", data={"text/markdown": "→ what was seen"}),
        nbformat.v4.new_output("stream", name="stdout", text="13 cells\n"),
    ]
    node = nbformat.v4.new_notebook(cells=[cell])
    render_lessons.keep_readable_outputs(node)
    assert [o.get("text") or o["data"].get("text/markdown") for o in cell.outputs] == ["→ what was seen", "13 cells\n"]
    cell.outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="128 != 96", traceback=[])]
    with pytest.raises(SystemExit, match="AssertionError.*128 != 96"):
        render_lessons.keep_readable_outputs(node)


def test_a_still_takes_its_caption_as_image_text():
    body = "![png](01_files/output_9_0.png)\n\n\n→ After prefill: 13 cells of `seq 0`, **swa_full** on\n"
    out = render_lessons.STILL_THEN_CAPTION.sub(
        lambda m: f"![{render_lessons.alt_text(m.group(3))}]({m.group(1)}){m.group(2)}→ {m.group(3)}", body)
    assert out.startswith("![After prefill: 13 cells of seq 0, swa_full on](01_files/output_9_0.png)")
    assert out.endswith("→ After prefill: 13 cells of `seq 0`, **swa_full** on\n")


def test_the_check_finds_a_changed_cell_and_a_missing_still(tmp_path, monkeypatch):
    monkeypatch.setattr(render_lessons, "RENDERED", tmp_path)
    monkeypatch.setattr(render_lessons, "ROOT", tmp_path.parent)
    notebook = tmp_path / "09-demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("a = 1\nprint(a)")]), notebook)
    assert "is missing" in render_lessons.stale(notebook)[0]
    (tmp_path / "09-demo.md").write_text("```python\na = 1\nprint(a)\n```\n![still](09-demo_files/s.png)\n")
    assert render_lessons.stale(notebook) == [f"{tmp_path.name}/09-demo.md shows 09-demo_files/s.png, which is missing"]
    (tmp_path / "09-demo_files").mkdir()
    (tmp_path / "09-demo_files" / "s.png").write_bytes(b"png")
    assert render_lessons.stale(notebook) == []
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("a = 2\nprint(a)")]), notebook)
    assert "lacks the cell starting 'a = 2'" in render_lessons.stale(notebook)[0]


@pytest.mark.parametrize("notebook", render_lessons.notebooks([]), ids=lambda p: p.stem)
def test_every_notebook_has_a_current_rendered_copy_with_stills(notebook):
    """Rerun `python tools/render_lessons.py NN` after changing notebook NN."""
    assert render_lessons.stale(notebook) == []
    assert "![" in render_lessons.rendered_path(notebook).read_text(encoding="utf-8"), "no still of a key moment"
