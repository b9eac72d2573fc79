"""Render the teaching notebooks as Markdown with their outputs, under docs/lessons/, for readers on a code host.

The committed notebooks are stored without outputs (tests run them stripped), and their live views (plotly
widgets) draw only in a running JupyterLab. This runs each notebook top to bottom with KVSCOPE_LESSON_PICTURES=1,
so that every `lessons.picture(view, caption)` also shows a PNG still of the view (kaleido, through the machine's
Chrome or Chromium), then writes docs/lessons/NN-name.md with the code, the printed outputs, the sentences and
those stills (docs/lessons/NN-name_files/). Live-only outputs (widgets, interactive figures) are left out: the
stills stand for them. Links are rewritten to work from docs/lessons/, and links to a notebook point to its
rendered copy.

    python tools/render_lessons.py                 # render every notebook (a few minutes)
    python tools/render_lessons.py 02 05           # only the notebooks whose names start so
    python tools/render_lessons.py --check         # exit 1 if a rendered copy lacks a notebook's current code
"""
from __future__ import annotations

import argparse
import os
import posixpath
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RENDERED = ROOT / "docs" / "lessons"
LIVE_ONLY = ("application/vnd.jupyter.widget-view+json", "application/vnd.plotly.v1+json")
HTML_LIMIT = 20_000  # bytes: a sentence or a reveal box is kept, a figure's inlined page is not
STILL_THEN_CAPTION = re.compile(r"!\[png\]\(([^)\s]+)\)(\s*)→ ([^\n]+)")
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def notebooks(prefixes: list[str]) -> list[Path]:
    found = sorted(NOTEBOOKS.glob("*.ipynb"))
    if prefixes:
        found = [p for p in found if any(p.name.startswith(prefix) for prefix in prefixes)]
        if not found:
            raise SystemExit(f"no notebook in {NOTEBOOKS} starts with {' or '.join(prefixes)}")
    return found


def rendered_path(notebook: Path) -> Path:
    return RENDERED / f"{notebook.stem}.md"


def code_sources(notebook_node) -> list[str]:
    return [cell.source.strip() for cell in notebook_node.cells if cell.cell_type == "code" and cell.source.strip()]


def execute(notebook: Path):
    """The notebook run top to bottom in a fresh kernel (in an empty folder, as the tests run it), with stills."""
    import nbclient
    import nbformat

    node = nbformat.read(notebook, as_version=4)
    os.environ["KVSCOPE_LESSON_PICTURES"] = "1"  # the kernel inherits it
    with tempfile.TemporaryDirectory() as folder:
        nbclient.NotebookClient(node, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": folder}}).execute()
    return node


def keep_readable_outputs(node) -> None:
    """Drop what only a live notebook draws; an error anywhere stops the render (a copy must not show one)."""
    for cell in node.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            if output.output_type == "error":
                raise SystemExit(f"{output.ename} in a cell starting {cell.source[:60]!r}: {output.evalue}")
            data = output.get("data", {})
            if any(kind in data for kind in LIVE_ONLY):
                continue
            if "text/html" in data and len(data["text/html"]) > HTML_LIMIT:
                continue
            kept.append(output)
        cell.outputs = kept


def relink(text: str, source_folder: Path) -> str:
    """Relative links written for notebooks/ made right from docs/lessons/; a notebook's link goes to its copy."""
    def move(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("/"):
            return match.group(0)
        absolute = (source_folder / target).resolve()
        if absolute.suffix == ".ipynb" and absolute.parent == NOTEBOOKS:
            absolute = rendered_path(absolute)
        moved = posixpath.relpath(absolute.as_posix(), RENDERED.resolve().as_posix())
        return f"{match.group(1)}{moved}{match.group(3) or ''}{match.group(4)}"
    return LINK.sub(move, text)


def alt_text(caption: str) -> str:
    """A still's caption as its image text (what a screen reader says, and what shows when it does not load)."""
    return re.sub(r"[\[\]`*]", "", caption).strip()


def render(notebook: Path) -> Path:
    from nbconvert import MarkdownExporter

    node = execute(notebook)
    keep_readable_outputs(node)
    for cell in node.cells:
        if cell.cell_type == "markdown":
            cell.source = relink(cell.source, NOTEBOOKS)
    files = f"{notebook.stem}_files"
    body, resources = MarkdownExporter().from_notebook_node(node, resources={"output_files_dir": files})
    shutil.rmtree(RENDERED / files, ignore_errors=True)
    for name, data in resources.get("outputs", {}).items():
        path = RENDERED / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    body = STILL_THEN_CAPTION.sub(lambda m: f"![{alt_text(m.group(3))}]({m.group(1)}){m.group(2)}→ {m.group(3)}", body)
    live = posixpath.relpath((NOTEBOOKS / notebook.name).as_posix(), RENDERED.as_posix())
    header = (f"<!-- Written by tools/render_lessons.py from notebooks/{notebook.name}: edit the notebook, not this. -->\n"
              f"> A rendered copy of [the notebook]({live}), run once on the demo model with its outputs and stills"
              f" of its live views. Run the notebook in JupyterLab to step through it and change it.\n\n")
    out = rendered_path(notebook)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + body.strip() + "\n", encoding="utf-8")
    return out


def stale(notebook: Path) -> list[str]:
    """What the rendered copy of a notebook lacks: the copy itself, a code cell as it is now, or a still it shows."""
    import nbformat

    out = rendered_path(notebook)
    if not out.exists():
        return [f"{out.relative_to(ROOT)} is missing"]
    text = out.read_text(encoding="utf-8")
    problems = [f"{out.relative_to(ROOT)} lacks the cell starting {source.splitlines()[0]!r}"
                for source in code_sources(nbformat.read(notebook, as_version=4)) if source not in text]
    for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
        if not (RENDERED / image).exists():
            problems.append(f"{out.relative_to(ROOT)} shows {image}, which is missing")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", help="render only the notebooks whose names start so (02, 05-...)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a rendered copy lacks a notebook's code")
    args = parser.parse_args(argv)
    chosen = notebooks(args.prefixes)
    if args.check:
        problems = [problem for notebook in chosen for problem in stale(notebook)]
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for notebook in chosen:
        print(f"{notebook.name} ...", flush=True)
        print(f"  -> {render(notebook).relative_to(ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
