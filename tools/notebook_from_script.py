"""Write a notebook (.ipynb, outputs stripped) from a script in the "percent" format that VS Code, Spyder
and jupytext read: `# %%` starts a code cell, `# %% [markdown]` a markdown cell whose lines start with
`# `. The teaching notebooks were written this way; edit them in JupyterLab or VS Code afterwards and
keep them stripped (tests/test_notebooks.py checks).

    python tools/notebook_from_script.py notebook.py notebooks/NN-name.ipynb
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def cells_of(text: str) -> list:
    cells, kind, lines = [], None, []

    def flush() -> None:
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            cells.append(new_markdown_cell(body))
        elif kind == "code" and body:
            cells.append(new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def main(source: str, target: str) -> None:
    notebook = new_notebook(cells=cells_of(Path(source).read_text()),
                            metadata={"kernelspec": KERNEL, "language_info": {"name": "python"}})
    for cell in notebook.cells:
        cell.pop("id", None)  # ids change on every build; git diffs stay readable without them
    notebook.nbformat_minor = 4
    nbformat.write(notebook, target)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
