"""A watcher (a replay viewer, a notebook that only watches) imports the event records and the mirrors
without torch or the model code: `import engine` is lazy (PEP 562) and those modules never import torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TORCH = "import sys; sys.modules['torch'] = None  # any 'import torch' now raises ImportError\n"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)


def test_events_and_mirrors_import_and_work_without_torch():
    done = run_python("""
        import engine.events, engine.watch.mirror, engine.watch.device_mirror
        import engine
        bus = engine.EventBus()
        mirror = engine.CacheMirror()
        mirror.attach(bus)
        bus.publish(engine.events.DecodeStarted(1, 1, (0,)))
        assert mirror.sync() == 1
        assert isinstance(engine.KvscopeError("x"), Exception)
        loaded = sorted(m for m in sys.modules if m.startswith("engine"))
        print(" ".join(loaded))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.events", "engine.watch.mirror", "engine.watch.device_mirror"} <= loaded
    assert not loaded & {"engine.context", "engine.models.model", "engine.kv.cache"}, loaded


def test_the_blocked_import_really_blocks_torch():
    """The check above means something only if reaching the model code fails under the same block."""
    done = run_python("import engine; engine.Context")
    assert done.returncode != 0 and "import of torch halted" in done.stderr
