"""The README's Python blocks run as written, on the bundled demo model."""
from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def run(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    return scope


def test_readme_python_block_runs_on_the_demo_model():
    scope = run(python_block_after("## Python API"))
    ctx, mirror = scope["ctx"], scope["mirror"]
    assert scope["rc"] == 0
    assert mirror.cells(0, "base")[0][1] == frozenset({0, 1})  # the seq_cp, seen through the events
    assert {d.name for d in ctx.memory_breakdown()} == {"CPU", "VGPU0"}
    assert ctx.memory.swa.layout.n_swa == 32


def test_readme_live_layer_block_runs():
    scope = run(python_block_after("### The live layer"))
    watcher, frame = scope["watcher"], scope["frame"]
    assert scope["session"].status().state == "closed"
    assert "token ' Moses'" in watcher.history.explain("base", 0, 5)
    assert frame.stream("base").used == watcher.mirror.caches["base"].streams[0].pos.__ge__(0).sum() > 0
