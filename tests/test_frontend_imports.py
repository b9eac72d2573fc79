"""The front-ends (tui/, explorer/) stand on the session, the watch layer and the event records only: they
never import the cache, the model, the context, or start threads of their own. This test reads their
imports with `ast` (nothing is imported), and checks the checker on a package made here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONT_ENDS = ("tui", "explorer")
ALLOWED = ("engine.events", "engine.errors", "engine.watch", "engine.runners.session", "engine.runners.workloads",
           "engine.runners.demo", "engine.runners.launch")
FORBIDDEN_NAMES = {"threading": "a thread of its own (the session's worker runs the engine)"}


def engine_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; `from engine import x` counts as engine.x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "engine":
                found += [(node.lineno, f"engine.{alias.name}") for alias in node.names]
    return found


def violations(package: Path) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        for line, module in engine_imports(path):
            where = f"{path.relative_to(package.parent)}:{line}"
            top = module.split(".")[0]
            if top in FORBIDDEN_NAMES:
                bad.append(f"{where}: imports {module}: {FORBIDDEN_NAMES[top]}")
            elif top == "torch":
                bad.append(f"{where}: imports torch")
            elif top == "engine" and module != "engine" and not any(
                    module == a or module.startswith(a + ".") for a in ALLOWED):
                bad.append(f"{where}: imports {module}; a front-end may import {', '.join(ALLOWED)}")
            elif module == "engine":
                pass  # `import engine` alone names nothing; what it reaches is checked as engine.x above
    return bad


def test_the_checker_finds_what_a_front_end_must_not_import(tmp_path):
    package = tmp_path / "fake_ui"
    package.mkdir()
    (package / "good.py").write_text("from engine import events as ev\nfrom engine.watch import Watcher\n"
                                     "from engine.runners.session import Session\nimport engine.watch.frames\n")
    (package / "bad.py").write_text("from engine.kv.cache import KVCache\nimport torch\nimport threading\n"
                                    "from engine import context\nfrom engine.models.model import load_model\n")
    found = violations(package)
    assert [v.split(": ", 1)[0] for v in found] == ["fake_ui/bad.py:1", "fake_ui/bad.py:2", "fake_ui/bad.py:3",
                                                    "fake_ui/bad.py:4", "fake_ui/bad.py:5"]
    assert "imports engine.context" in found[3]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_front_ends_import_only_the_session_the_watch_layer_and_events(front_end):
    package = ROOT / front_end
    if not package.is_dir():
        pytest.skip(f"{front_end}/ does not exist yet (the terminal UI and notebook explorer issues add them)")
    assert violations(package) == []
