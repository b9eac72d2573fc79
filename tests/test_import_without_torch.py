"""A watcher (a replay viewer, a notebook that only watches) imports the event records and the mirrors
without torch or the model code: `import engine` is lazy (PEP 562) and those modules never import torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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


def test_recordings_write_and_replay_without_torch(tmp_path):
    """A replay viewer reads recordings on a machine without torch (engine/watch/codec.py, recording.py)."""
    done = run_python(f"""
        import numpy as np
        from engine import events as ev
        from engine.watch.codec import decode_event, encode_event
        from engine.watch.recording import Recorder, RecordingReader
        created = ev.ContextCreated(cache="kv", n_ctx=8, n_ctx_seq=8, kv_size=8, n_stream=1, n_seq_max=1, n_layer=1,
                                    type_k="f16", type_v="f16", v_trans=False, k_bytes=1, v_bytes=1, n_batch=8,
                                    n_ubatch=8, pad=8, unified=True, model_name="m", log_lines=())
        seq = np.zeros((256, 2), dtype=bool)
        seq[0] = True
        cells = ev.StreamCells(0, np.array([0, 1]), np.array([0, 1]), np.array([0, 0]), ev.pack_seq_bits(seq), 2)
        placed = ev.CellsAllocated(cache="kv", changes=(cells,), tokens=(np.array([5, 6]),))
        assert encode_event(decode_event(encode_event(placed))) == encode_event(placed)
        with Recorder({str(tmp_path / "t.kvtrace")!r}, keyframe_every=1) as rec:
            rec.write(created)
            rec.write(placed)
        with RecordingReader({str(tmp_path / "t.kvtrace")!r}) as reader:
            assert len(reader) == 2 and reader.keyframes == (0, 1)
            assert reader.mirror_at(1).cells(0) == [(0, frozenset({{0}}), 0), (1, frozenset({{0}}), 0)] + [
                (-1, frozenset(), 0)] * 6
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.watch.codec", "engine.watch.recording"} <= loaded
    assert not loaded & {"engine.context", "engine.models.model", "engine.kv.cache"}, loaded


def test_a_remote_session_works_without_torch():
    """A laptop front-end drives a remote engine (engine/watch/remote.py) with no torch and no engine code."""
    done = run_python("""
        import socket
        from engine.watch.remote import RemoteSession, RemoteSessionError
        from engine.watch.watcher import Watcher
        with socket.socket() as probe:  # a port where nothing listens
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with RemoteSession(f"tcp://127.0.0.1:{port}", timeout=0.3) as remote:
            assert remote.status().state == "disconnected"
            try:
                remote.start().result(10)
            except RemoteSessionError as e:
                assert "no answer from tcp://127.0.0.1" in str(e), e
            else:
                raise AssertionError("a command to nowhere succeeded")
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.watch.remote", "engine.watch.protocol", "engine.watch.codec"} <= loaded
    assert not loaded & {"engine.context", "engine.models.model", "engine.runners.session", "engine.kv.cache"}, loaded


def test_the_blocked_import_really_blocks_torch():
    """The check above means something only if reaching the model code fails under the same block."""
    done = run_python("import engine; engine.Context")
    assert done.returncode != 0 and "import of torch halted" in done.stderr


def test_both_explorers_import_without_torch():
    """A laptop that only watches (a remote session, a recording) has no torch: the terminal app, the
    notebook explorer and the launcher they share import without it."""
    import pytest

    pytest.importorskip("textual", reason="the terminal explorer needs the tui extra")
    pytest.importorskip("ipywidgets", reason="the notebook explorer needs the jupyter extra")
    done = run_python("""
        import explorer, tui.app, kvscope.launcher
        from explorer import Explorer, Compare
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.llama_flags", "engine.runners.launch"} <= loaded
    assert not loaded & {"engine.context", "engine.runners.session", "engine.kv.cache"}, loaded


def test_attaching_to_a_llama_cpp_log_works_without_torch():
    """`kvscope attach` watches a real llama.cpp from its log (engine/runners/attach.py): the machine that runs
    llama.cpp needs no torch for it."""
    log = Path(__file__).parent / "data" / "llama-cpp-logs" / "llama-cpp-kv-debug3-unified.log"
    done = run_python(f"""
        from pathlib import Path
        from engine.runners.attach import AttachedLog
        from engine.runners.attach_command import run_attach
        from engine.runners.attach_frames import print_frames
        from engine.watch.watcher import Watcher
        log = Path({str(log)!r})
        with AttachedLog.read(log, start=False) as attached:
            watcher = Watcher.of(attached)
            attached.start()
            assert attached.wait(30)
            watcher.poll()
        assert watcher.status.state == "finished" and watcher.mirror.caches["kv"].streams[0].pos.max() >= 0
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.runners.attach", "engine.watch.llama_log"} <= loaded
    assert not loaded & {"engine.context", "engine.models.model", "engine.runners.session", "engine.kv.cache"}, loaded
    assert not any(m.startswith("engine.models") for m in loaded), loaded


def test_a_llama_cpp_log_is_read_without_torch():
    """Watching a real llama.cpp needs no torch: the log parser lives with the watch layer."""
    log = Path(__file__).parent / "data" / "llama-cpp-logs" / "llama-cpp-kv-debug3-unified.log"
    done = run_python(f"""
        from engine.watch.llama_log import LlamaLogParser
        from engine.watch.mirror import CacheMirror
        parser = LlamaLogParser()
        mirror = CacheMirror()
        mirror.apply_all(parser.feed(open({str(log)!r}, "rb").read()) + parser.finish())
        assert parser.stats.dumps == 25 and mirror.caches["kv"].size == 256
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    assert "engine.watch.llama_log.parser" in done.stdout.split()
