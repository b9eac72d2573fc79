"""docs/how-the-kv-cache-works.md draws its diagrams with kvscope (tools/draw_doc_diagrams.py): each is a small
scenario on the demo model, drawn from a watcher's frames. The doc must hold exactly what the engine draws now,
so a change of the cache's behaviour (a slot search, a head rule, a shift, a size) shows up here as a failure
with the diff, and `python tools/draw_doc_diagrams.py` rewrites the doc."""
from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "draw_doc_diagrams.py"
DOC = ROOT / "docs" / "how-the-kv-cache-works.md"


def load_tool():
    spec = importlib.util.spec_from_file_location("draw_doc_diagrams", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_doc_holds_what_the_engine_draws(capsys) -> None:
    tool = load_tool()
    t0 = time.monotonic()
    rc = tool.main(["--check"])
    out = capsys.readouterr().out
    print(f"{len(tool.DIAGRAMS)} diagrams drawn and compared in {time.monotonic() - t0:.1f} s")
    assert rc == 0, out


def test_rewrite_replaces_only_the_blocks_and_needs_every_one() -> None:
    tool = load_tool()
    names = list(tool.DIAGRAMS)
    doc = "".join(f"text {n}\n<!-- diagram: {n} -->\nold\n<!-- /diagram -->\n" for n in names)
    new = tool.rewrite(doc, {n: f"```text\n{n}\n```\n" for n in names})
    assert new == "".join(f"text {n}\n<!-- diagram: {n} -->\n```text\n{n}\n```\n<!-- /diagram -->\n" for n in names)
    with pytest.raises(SystemExit, match="diagrams without a block"):
        tool.rewrite(doc.replace(f"<!-- diagram: {names[0]} -->", ""), {n: "" for n in names})


def test_every_diagram_block_of_the_doc_is_drawn() -> None:
    found = re.findall(r"<!-- diagram: ([a-z0-9-]+) -->", DOC.read_text(encoding="utf-8"))
    assert sorted(found) == sorted(load_tool().DIAGRAMS)


def test_the_doc_links_to_files_and_headings_that_exist() -> None:
    """Relative links resolve (the notebooks, written alongside, are left to tests/test_notebooks.py), and a
    link into the README or another doc names one of its headings."""
    text = DOC.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")) or "notebooks/" in target and target.endswith(".ipynb"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (DOC.parent / path).resolve() if path else DOC
        assert resolved.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, target
