"""kvscope attached to a real llama.cpp: llama-server and llama-cli built from llama.cpp's source (see
docs/watching-llama-cpp.md), started by AttachedLog.run, driven over HTTP or to the end of a prompt.
The explorer's cells (its watcher's mirror) must be what the process's own log shows at its last dumps,
and the server's slots what its slot lines say.

Skipped where no binary is found: set KVSCOPE_LLAMA_BIN to the folder that holds llama-server and llama-cli.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from engine import events as ev
from engine.models.model import DEMO_MODEL_PATH
from engine.watch.llama_log import LlamaLogParser
from engine.watch.watcher import Watcher
from tests.test_llama_log import dumps_in, rendered

LLAMA_BIN = Path(os.environ.get("KVSCOPE_LLAMA_BIN") or Path(shutil.which("llama-server") or "").parent)
SERVER, CLI = LLAMA_BIN / "llama-server", LLAMA_BIN / "llama-cli"
pytestmark = pytest.mark.skipif(not SERVER.is_file() or not CLI.is_file(),
                                reason="no llama.cpp binaries (llama-server, llama-cli): set KVSCOPE_LLAMA_BIN to "
                                       "their folder; docs/watching-llama-cpp.md says how to build them")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def wait_ready(port: int, attached, seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert attached.returncode is None, f"llama-server exited: {attached.last_lines(10)}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("llama-server did not answer /health")


def last_dumps(text: str) -> dict[tuple[int, int, int], dict]:
    """The last dump of each (size, n_swa, stream) of a log."""
    out = {}
    for dump in dumps_in(text):
        if dump["map"]:
            summary = dump["summary"]
            stream = int(summary.split("[")[1].split("]")[0])
            size = int(summary.split("size =")[1].split(",")[0])
            out[(size, int(summary.rsplit("=", 1)[1]), stream)] = dump
    return out


def assert_cells_are_the_logs(watcher: Watcher, log_text: str) -> int:
    """The watcher's cells at the end, written as dumps, are the log's last dump of every stream."""
    mirror = watcher.mirror
    checked = 0
    for (size, n_swa, stream), dump in last_dumps(log_text).items():
        cache = next(name for name, c in mirror.caches.items()
                     if c.size == size and (name == "swa") == (n_swa > 0) and stream < len(c.streams))
        got = rendered(mirror, cache, stream, n_swa)
        assert got["summary"] == dump["summary"]
        assert got["map"] == dump["map"]
        assert [r.rstrip() for r in got["pos"]] == [r.rstrip() for r in dump["pos"]]
        assert got["minmax"] == dump["minmax"]
        checked += 1
    return checked


def drain(watcher: Watcher, attached) -> None:
    assert attached.wait(60), "the log was not read to its end"
    deadline = time.time() + 10
    while time.time() < deadline and watcher.poll():
        time.sleep(0.05)


@pytest.fixture(params=["demo", "tiny-llama"])
def server_model(request) -> tuple[str, Path, int]:
    """(name, GGUF, streams the log shows): the demo model (an iSWA gemma3: two caches, two slots each) and a
    tiny llama written by the tests (one cache)."""
    if request.param == "demo":
        return "demo", DEMO_MODEL_PATH, 4
    return "tiny-llama", request.getfixturevalue("tiny_llama_gguf"), 2


def test_llama_server(tmp_path, server_model):
    from engine.runners.attach import AttachedLog

    name, model, n_streams = server_model
    port = free_port()
    passthrough = tmp_path / "llama-server.log"
    attached = AttachedLog.run([str(SERVER), "-m", str(model), "-c", "1024", "-np", "2", "-t", "2",
                                "--port", str(port), "--no-webui", "--seed", "1"], passthrough=passthrough, start=False)
    watcher = Watcher.of(attached)
    attached.start()
    try:
        wait_ready(port, attached)
        story = "Once upon a time there was a cache that kept every key and every value it was given, and"
        first = post(port, "/completion", {"prompt": story, "n_predict": 12, "cache_prompt": True, "id_slot": 0})
        post(port, "/completion", {"prompt": story + first["content"] + " then", "n_predict": 8,
                                   "cache_prompt": True, "id_slot": 0})
        if name == "demo":  # the tiny llama has no chat template
            chat = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "What is a slot?"}],
                                                       "max_tokens": 8, "id_slot": 1})
            assert chat["choices"][0]["message"]["content"]
        else:
            post(port, "/completion", {"prompt": "What is a slot?", "n_predict": 8, "id_slot": 1})
        watcher.poll()
        assert watcher.status is not None and watcher.status.message == f"attached to llama-server (pid {attached.pid})"
    finally:
        attached.close()
    drain(watcher, attached)
    log_text = passthrough.read_text(errors="replace")
    assert "LLAMA_KV_CACHE_DEBUG=3" in attached.added and "-v" in attached.added
    assert assert_cells_are_the_logs(watcher, log_text) == n_streams  # two slots' streams, in each cache
    # its slots, from its slot lines: the second prompt on slot 0 reused what the first left
    slots = watcher.server.slots
    turns = [t for s in (0, 1) for t in slots[s].turns]
    assert [t.slot for t in turns] == [0, 0, 1]
    assert turns[0].n_past == 0 and turns[0].outcome == "new" and turns[1].n_past > 0
    # the window of the demo's sliding layers may make llama-server restore a checkpoint rather than keep
    # the prefix (the llama keeps it): whichever it did, its own line says so
    restored = f"task {turns[1].task} | restored context checkpoint" in log_text
    assert turns[1].outcome == ("restored" if restored else "kept")
    assert turns[1].n_past + turns[1].n_processed == turns[1].n_prompt
    assert all(t.stop == "limit" for t in turns)
    # what this watcher read equals what the parser reads from the saved log
    parser = LlamaLogParser()
    parser.feed(log_text)
    parser.finish()
    assert parser.stats.dumps_damaged == 0
    assert any(isinstance(e, ev.ProcessExited) for e in watcher.recent)


def test_llama_cli_on_a_tiny_llama(tmp_path, tiny_llama_gguf):
    from engine.runners.attach import AttachedLog

    passthrough = tmp_path / "llama-cli.log"
    attached = AttachedLog.run([str(CLI), "-m", str(tiny_llama_gguf), "-p", "hello there", "-n", "12", "-st", "-c", "256",
                                "-t", "2", "--seed", "1"], passthrough=passthrough, start=False)
    watcher = Watcher.of(attached)
    attached.start()
    try:
        drain(watcher, attached)
    finally:
        attached.close()
    assert attached.returncode == 0, attached.last_lines(20)
    log_text = passthrough.read_text(errors="replace")
    assert assert_cells_are_the_logs(watcher, log_text) == 1
    kv = watcher.mirror.caches["kv"]
    assert kv.size == 256 and (kv.streams[0].pos >= 0).sum() >= 12
    exited = [e for e in watcher.recent if isinstance(e, ev.ProcessExited)]
    assert exited and exited[-1].returncode == 0 and not exited[-1].ended_by_kvscope
