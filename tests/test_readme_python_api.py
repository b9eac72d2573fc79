"""The README's Python API block runs as written, on the bundled demo model."""
from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_api_block() -> str:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def test_readme_python_block_runs_on_the_demo_model():
    scope: dict = {}
    exec(compile(python_api_block(), str(README), "exec"), scope)  # noqa: S102 - the README's own code
    ctx, mirror = scope["ctx"], scope["mirror"]
    assert scope["rc"] == 0
    assert mirror.cells(0, "base")[0][1] == frozenset({0, 1})  # the seq_cp, seen through the events
    assert {d.name for d in ctx.memory_breakdown()} == {"CPU", "VGPU0"}
    assert ctx.memory.swa.layout.n_swa == 32
