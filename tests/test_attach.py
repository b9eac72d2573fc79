"""`kvscope attach` (engine/runners/attach.py): a real llama.cpp's cache from its own log, read from a saved
file, a file that grows, or a process started here (a fake llama.cpp that prints a fixture log), with its
recording, its text frames, its errors, and no process left behind whichever way kvscope ends."""
from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from engine import events as ev
from engine.cli import main
from engine.errors import KvscopeError
from engine.runners import attach as attach_module
from engine.runners.attach import AttachedLog, debug_command
from engine.runners.attach_frames import LEGEND
from engine.watch.llama_log import LlamaLogParser
from engine.watch.mirror import CacheMirror
from engine.watch.recording import RecordingReader
from engine.watch.watcher import Watcher

LOGS = Path(__file__).parent / "data" / "llama-cpp-logs"
FIXTURES = sorted(LOGS.glob("*.log"))
UNIFIED = LOGS / "llama-cpp-kv-debug3-unified.log"
SPLIT = LOGS / "llama-cpp-kv-debug3-split.log"
SERVER = LOGS / "llama-server-gemma3-swa-chat.log"
OUT_START, OUT_END = b"<generated text, ", b"written on stdout>\n"  # a line llama-cli-like, cut in two
STDOUT_LINE = (OUT_START + OUT_END).decode().rstrip("\n")
ROOT = Path(__file__).parent.parent

# A fake llama.cpp: records its argv and LLAMA_KV_CACHE_DEBUG, prints a log on stderr in pieces that end
# mid-line, with the start of a stdout line after the first piece and its end after the last (as llama-cli
# writes its text on stdout while it logs on stderr), then waits to be ended ("wait") or exits with the
# given status; "trap": waits, and notes a SIGTERM in a file before it exits.
FAKE_LLAMA = """\
import json, os, signal, sys, time
log, record, then = sys.argv[1], sys.argv[2], sys.argv[3]
if then == "trap":
    def noted(signum, frame):
        open(record + ".term", "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, noted)
with open(record + ".tmp", "w") as f:
    json.dump({"argv": sys.argv, "debug": os.environ.get("LLAMA_KV_CACHE_DEBUG"), "pid": os.getpid()}, f)
os.replace(record + ".tmp", record)
data = open(log, "rb").read()
for start in range(0, len(data), 20011):
    sys.stderr.buffer.write(data[start:start + 20011])
    sys.stderr.flush()
    if start == 0:
        sys.stdout.buffer.write(%r)
        sys.stdout.flush()
    time.sleep(0.01)
sys.stdout.buffer.write(%r)
sys.stdout.flush()
with open(record + ".done", "w"):
    pass
if then in ("wait", "trap"):
    while True:
        time.sleep(1)
sys.exit(int(then))
""" % (OUT_START, OUT_END)


# ---- helpers --------------------------------------------------------------------------------------------
def parsed_directly(data: bytes) -> tuple[CacheMirror, LlamaLogParser, list[ev.Event]]:
    parser = LlamaLogParser()
    events = parser.feed(data) + parser.finish()
    mirror = CacheMirror()
    mirror.apply_all(events)
    return mirror, parser, events


def picture_differences(a: CacheMirror, b: CacheMirror) -> list[str]:
    """Where two mirrors differ, other than the seq_no the bus stamped on the records they keep."""
    return [d for d in a.differences(b) if "/seq_no:" not in d]


def used_cells(mirror: CacheMirror) -> int:
    return sum(int((st.pos >= 0).sum()) for cache in mirror.caches.values() for st in cache.streams)


def wait_for(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def shows(watcher: Watcher, mirror: CacheMirror) -> bool:
    """The watcher, polled, shows the mirror's picture (a followed log's last dump is complete only once its
    input has been quiet for IDLE_SECONDS: wait_for(lambda: shows(...)) waits for it)."""
    watcher.poll()
    return picture_differences(mirror, watcher.mirror) == []


def watched(attached: AttachedLog) -> Watcher:
    watcher = Watcher.of(attached)
    attached.start()
    return watcher


def alive(pid: int) -> bool:
    """Running (a zombie has ended: only its parent's wait is missing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def fake_llama(tmp_path: Path) -> Path:
    script = tmp_path / "fake_llama.py"
    script.write_text(FAKE_LLAMA)
    return script


def kvscope(*args: str, cwd: Path) -> subprocess.Popen:
    # TMPDIR: the default passthrough file goes into the test's folder
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": str(cwd)}
    env.pop("LLAMA_KV_CACHE_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "attach", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ---- saved logs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("log", FIXTURES, ids=[p.name for p in FIXTURES])
def test_a_saved_log_gives_the_parsers_picture(log):
    direct, parser, events = parsed_directly(log.read_bytes())
    assert used_cells(direct) > 0
    with AttachedLog.read(log, start=False) as attached:
        watcher = watched(attached)  # subscribed first: every event, from the first line
        assert attached.wait(30)
        late = Watcher.of(attached)  # joins at the end: the state alone
        watcher.poll()
        late.poll()
        assert picture_differences(direct, watcher.mirror) == []
        assert picture_differences(direct, late.mirror) == []
        assert attached.stats.dumps == parser.stats.dumps > 0 and attached.stats.dumps_dropped == 0
        seen = [e for e in watcher.events_since(0) if isinstance(e, ev.CellsSeen)]
        assert len(seen) == sum(isinstance(e, ev.CellsSeen) for e in events)
        assert watcher.status.state == late.status.state == "finished"
        assert watcher.status.message == f"{log}: read to its end"
        stats = [e for e in watcher.events_since(0) if isinstance(e, ev.LogStats)]
        assert stats[-1].lines == parser.stats.lines and stats[-1].bytes == log.stat().st_size
        assert stats[-1].behind_bytes == 0 and stats[-1].source == str(log)
        assert attached.program == parser.program and watcher.status.workload == (parser.program or "llama.cpp")


def test_a_binary_file_is_read_with_every_line_skipped(tmp_path):
    garbage = bytes(range(256)) * 40 + b"\xff\xfe\x00 not a log \x1b[31m\n" * 50  # no empty line
    path = tmp_path / "garbage.bin"
    path.write_bytes(garbage)
    with AttachedLog.read(path) as attached:
        assert attached.wait(20)
        stats = attached.stats
    assert stats.lines == garbage.count(b"\n") and stats.skipped == stats.lines
    assert stats.dumps == 0 and attached.status.state == "finished"


def test_a_missing_or_unreadable_log_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nowhere.log"
    with pytest.raises(KvscopeError, match=r"cannot read '.*nowhere.log': No such file"):
        AttachedLog.read(missing)
    assert main(["attach", "--log", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: attach --log: cannot read '{missing}': No such file or directory"
    assert main(["attach", "--log", str(tmp_path)]) == 1
    assert "Is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    ([], "nothing to watch: give a command to run after --"),
    (["--log", "x.log", "--", "llama-server"], "give --log FILE or a command after --, not both"),
    (["--follow", "--", "llama-server"], "--follow goes with --log FILE"),
    (["--log", "x.log", "--passthrough", "p.log"], "--passthrough goes with a command run here"),
    (["--seconds", "0", "--", "llama-server"], "--seconds must be > 0, got 0.0"),
])
def test_flags_that_do_not_go_together_are_refused(argv, message, capsys):
    assert main(["attach", *argv]) == 1
    assert f"error: attach: {message}" in capsys.readouterr().err


def test_a_parser_failure_is_told_and_ends_the_reading(tmp_path, monkeypatch, capsys):
    class FailingParser(LlamaLogParser):
        def feed(self, data):
            if b"seq_keep" in data:
                raise RuntimeError("a bug of the parser")
            return super().feed(data)

    monkeypatch.setattr(attach_module, "LlamaLogParser", FailingParser)
    with AttachedLog.read(UNIFIED, start=False) as attached:
        watcher = watched(attached)
        assert attached.wait(20)
        watcher.poll()
    assert isinstance(attached.error, RuntimeError) and watcher.status.state == "stopped"
    assert watcher.status.message == (f"kvscope stopped reading {UNIFIED}: the parser failed: RuntimeError: a bug "
                                      f"of the parser")
    assert main(["attach", "--log", str(UNIFIED), "-o", str(tmp_path / "out.kvtrace")]) == 1
    assert capsys.readouterr().err.rstrip().endswith("error: kvscope stopped reading "
                                                     f"{UNIFIED}: the parser failed: RuntimeError: a bug of the parser")


# ---- a file that grows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_follow_reads_a_file_written_in_pieces(tmp_path, line_end):
    text = UNIFIED.read_bytes()
    data = text.replace(b"\n", line_end)
    path = tmp_path / "growing.log"
    path.write_bytes(b"")
    with AttachedLog.read(path, follow=True, start=False) as attached:
        watcher = watched(attached)
        mid_line = data.index(b"find_slot", len(data) // 3) + 5  # a piece that ends inside a line
        cuts = [0, 7, len(data) // 5, mid_line, len(data) * 3 // 5, len(data) - 3, len(data)]
        with open(path, "ab") as f:
            for a, b in itertools.pairwise(cuts):
                f.write(data[a:b])
                f.flush()
                if b == mid_line:  # the cut line waits for its end, even once the input goes quiet
                    complete = data.rfind(b"\n", 0, b) + 1
                    wait_for(lambda: attached.stats.bytes == complete, what="the piece's complete lines")
                    time.sleep(attach_module.IDLE_SECONDS * 2)
                    assert attached.stats.lines == data[:b].count(b"\n")
                time.sleep(0.03)
        direct, parser, _ = parsed_directly(text)  # the LF text: a CRLF log means the same
        wait_for(lambda: attached.stats.bytes == len(data) and shows(watcher, direct), what="the whole log")
        assert not attached.finished and watcher.status.state == "attached"
        assert watcher.status.message == f"following {path}"
        assert attached.stats.lines == parser.stats.lines and attached.stats.dumps == parser.stats.dumps
    watcher.poll()
    assert watcher.status.state == "closed"


@pytest.mark.parametrize("how", ["truncated", "replaced"])
def test_a_followed_file_truncated_or_replaced_is_read_again_as_a_new_log(tmp_path, how):
    first, second = SPLIT.read_bytes(), UNIFIED.read_bytes()
    path = tmp_path / "server.log"
    path.write_bytes(first)
    with AttachedLog.read(path, follow=True, start=False) as attached:
        watcher = watched(attached)
        wait_for(lambda: attached.stats.bytes == len(first), what="the first log")
        if how == "truncated":
            with open(path, "r+b") as f:
                f.truncate(0)
            wait_for(lambda: attached.status.message.endswith("as a new log"), what="the truncation")
            with open(path, "ab") as f:
                f.write(second)
        else:
            (tmp_path / "new.log").write_bytes(second)
            os.replace(tmp_path / "new.log", path)
        direct, _, _ = parsed_directly(second)
        assert direct.n_stream("kv") == 1 and parsed_directly(first)[0].n_stream("kv") == 3  # they differ
        # the new log's counts start from 0
        wait_for(lambda: attached.stats.bytes == len(second) and shows(watcher, direct), what="the second log")
        assert f"{path} was {how}: reading it again from its start, as a new log" in [
            e.message for e in watcher.events_since(0) if isinstance(e, ev.SessionStatus)]


def test_a_live_source_behind_drops_dumps_and_ends_on_the_same_picture(tmp_path, monkeypatch):
    """Behind (here: always, BEHIND_BYTES 0), the parser decodes only the last waiting dump of each stream:
    dumps are dropped and counted, and the picture after the last dump is the same. A saved log read
    without --follow never drops one."""
    monkeypatch.setattr(attach_module, "BEHIND_BYTES", 0)
    data = SERVER.read_bytes()
    direct, parser, _ = parsed_directly(data)
    path = tmp_path / "server.log"
    path.write_bytes(data)
    with AttachedLog.read(path, follow=True, start=False) as attached:
        watcher = watched(attached)
        wait_for(lambda: attached.stats.bytes == len(data) and shows(watcher, direct), what="the log")
        assert 0 < attached.stats.dumps_dropped < parser.stats.dumps
    with AttachedLog.read(path) as saved:
        assert saved.wait(30) and saved.stats.dumps_dropped == 0


# ---- recording a saved log ---------------------------------------------------------------------------------
def test_attach_log_with_output_records_every_event(tmp_path, capsys):
    out = tmp_path / "server.kvtrace"
    assert main(["attach", "--log", str(SERVER), "-o", str(out), "--keyframe-every", "50"]) == 0
    err = capsys.readouterr().err
    assert "kvscope attach: wrote " in err and f"to {out}" in err
    direct, _, events = parsed_directly(SERVER.read_bytes())
    with AttachedLog.read(SERVER, start=False) as attached:
        live = watched(attached)
        assert attached.wait(30)
        live.poll()
    with RecordingReader(out) as reader:
        assert not reader.truncated, reader.warnings
        last = reader.mirror_at(len(reader) - 1)
        recorded = list(reader.events())
        assert len(reader.keyframes) > 1  # a replay seeks through it
    assert picture_differences(live.mirror, last) == []
    assert picture_differences(direct, last) == []
    assert sum(isinstance(e, ev.CellsSeen) for e in recorded) == sum(isinstance(e, ev.CellsSeen) for e in events)
    assert [e.state for e in recorded if isinstance(e, ev.SessionStatus)][-1] == "finished"
    assert isinstance(recorded[-1], (ev.LogStats, ev.SessionStatus))


# ---- a process started here ---------------------------------------------------------------------------------
def test_debug_command_adds_only_what_is_missing():
    plain = debug_command(["llama-server", "-m", "m.gguf"], {"PATH": "/bin"})
    assert plain.argv == ["llama-server", "-m", "m.gguf", "-v"] and plain.env["LLAMA_KV_CACHE_DEBUG"] == "3"
    assert plain.added == ["LLAMA_KV_CACHE_DEBUG=3", "-v"] and plain.env["PATH"] == "/bin"
    for flags in (["-v"], ["--verbose"], ["-lv", "1"], ["--log-verbosity", "4"], ["--verbosity", "2"]):
        kept = debug_command(["llama-cli", *flags], {"LLAMA_KV_CACHE_DEBUG": "3"})
        assert kept.argv == ["llama-cli", *flags] and kept.added == [], flags
    quiet = debug_command(["llama-cli", "-lv", "0"], {"LLAMA_KV_CACHE_DEBUG": "1"})
    assert quiet.argv == ["llama-cli", "-lv", "0", "-v"] and quiet.env["LLAMA_KV_CACHE_DEBUG"] == "3"
    assert quiet.added == ["LLAMA_KV_CACHE_DEBUG=3 (was 1)",
                           "-v (the command's verbosity 0 hides the debug lines the dumps are)"]
    assert debug_command(["llama-cli", "-v", "-lv", "0"], {}).argv[-1] == "-v"  # the last flag wins in llama.cpp
    assert debug_command(["x"], {"LLAMA_KV_CACHE_DEBUG": "5"}).env["LLAMA_KV_CACHE_DEBUG"] == "5"


def test_a_command_that_exits_by_itself(tmp_path, fake_llama):
    """The child gets LLAMA_KV_CACHE_DEBUG=3 and -v, its raw output lands in the passthrough byte for byte,
    its exit status becomes kvscope's, and the recording ends with its ProcessExited and last lines."""
    out, record, passthrough = tmp_path / "run.kvtrace", tmp_path / "child.json", tmp_path / "pass.log"
    proc = kvscope("-o", str(out), "--passthrough", str(passthrough), "--", sys.executable, str(fake_llama),
                   str(SERVER), str(record), "3", cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr.decode()
    child = json.loads(record.read_text())
    assert child["debug"] == "3" and child["argv"][1:] == [str(SERVER), str(record), "3", "-v"]
    stderr = stderr.decode()
    assert "kvscope attach: added LLAMA_KV_CACHE_DEBUG=3, -v\n" in stderr
    assert f"kvscope attach: its output (stdout and stderr) goes to {passthrough}\n" in stderr
    assert "Traceback" not in stderr and stdout == b""
    raw = passthrough.read_bytes()
    log = SERVER.read_bytes()
    assert len(raw) == len(OUT_START) + len(OUT_END) + len(log)
    assert raw.replace(OUT_START, b"", 1).replace(OUT_END, b"", 1) == log  # each write whole, in order
    with RecordingReader(out) as reader:
        assert not reader.truncated, reader.warnings
        recorded = list(reader.events())
        last = reader.mirror_at(len(reader) - 1)
    exited = [e for e in recorded if isinstance(e, ev.ProcessExited)]
    assert len(exited) == 1 and exited[0].returncode == 3 and not exited[0].ended_by_kvscope
    assert exited[0].pid == child["pid"] and exited[0].program == "llama-server"
    assert set(exited[0].last_lines[-2:]) == {log.decode().splitlines()[-1], STDOUT_LINE}  # either came last
    status = [e for e in recorded if isinstance(e, ev.SessionStatus)]
    assert status[0].message == f"attached to {Path(sys.executable).name} (pid {child['pid']})"
    assert status[-1].state == "exited" and status[-1].message.endswith("exited (exit status 3)")
    assert picture_differences(parsed_directly(log)[0], last) == []


def test_sigterm_ends_kvscope_and_its_command_with_a_complete_recording(tmp_path, fake_llama):
    out, record = tmp_path / "run.kvtrace", tmp_path / "child.json"
    proc = kvscope("-o", str(out), "--", sys.executable, str(fake_llama), str(UNIFIED), str(record), "wait",
                   cwd=tmp_path)
    try:
        wait_for(lambda: Path(f"{record}.done").exists(), what="the child's log")
        child = json.loads(record.read_text())["pid"]
        assert alive(child)
        time.sleep(0.5)  # kvscope reads what the child printed
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr.decode()
    wait_for(lambda: not alive(child), timeout=5, what="the child's end")
    assert "ended by kvscope (killed by SIGTERM)" in stderr.decode()
    with RecordingReader(out) as reader:
        assert not reader.truncated, reader.warnings
        recorded = list(reader.events())
        last = reader.mirror_at(len(reader) - 1)
    exited = [e for e in recorded if isinstance(e, ev.ProcessExited)]
    assert len(exited) == 1 and exited[0].ended_by_kvscope and exited[0].returncode == -signal.SIGTERM
    assert set(exited[0].last_lines[-2:]) == {"done", STDOUT_LINE}  # the log's last line, stdout's line
    assert picture_differences(parsed_directly(UNIFIED.read_bytes())[0], last) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_kvscope_leaves_no_process_behind(tmp_path, fake_llama):
    record = tmp_path / "child.json"
    proc = kvscope("-o", str(tmp_path / "run.kvtrace"), "--", sys.executable, str(fake_llama), str(SPLIT),
                   str(record), "wait", cwd=tmp_path)
    try:
        # silent from here on: a child still writing would die of SIGPIPE by itself
        wait_for(lambda: Path(f"{record}.done").exists(), what="the child's log")
        child = json.loads(record.read_text())["pid"]
        assert alive(child)
        os.kill(proc.pid, signal.SIGKILL)  # no handler, no atexit: only the kernel can end the child now
        proc.wait(timeout=10)
        wait_for(lambda: not alive(child), timeout=5, what="the orphan's end")
    finally:
        proc.kill()
        if record.exists() and alive(json.loads(record.read_text())["pid"]):
            os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)


def test_close_ends_the_process_group_and_is_idempotent(tmp_path, fake_llama):
    record = tmp_path / "child.json"
    attached = AttachedLog.run([sys.executable, str(fake_llama), str(UNIFIED), str(record), "wait"])
    try:
        assert attached.label == f"{Path(sys.executable).name} (pid {attached.pid})"
        assert attached.passthrough_path.exists() and attached.added == ["LLAMA_KV_CACHE_DEBUG=3", "-v"]
        wait_for(lambda: Path(f"{record}.done").exists(), what="the child's log")
        assert os.getpgid(attached.pid) == attached.pid  # its own group: kvscope's Ctrl+C is kvscope's
        assert not attached.finished and attached.returncode is None
    finally:
        attached.close()
        attached.close()
    assert attached.finished and attached.ended_by_kvscope and attached.returncode == -signal.SIGTERM
    assert not alive(attached.pid)
    assert set(attached.last_lines(2)) == {"done", STDOUT_LINE} and len(attached.last_lines(5)) == 5
    attached.passthrough_path.unlink()


def test_a_script_that_ends_without_closing_ends_its_process(tmp_path, fake_llama):
    """engine/watch/lifetime.py closes it at interpreter exit: SIGTERM, which the child notes (the kernel's
    PR_SET_PDEATHSIG would send SIGKILL, which nothing can note)."""
    record = tmp_path / "child.json"
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from engine.runners.attach import AttachedLog
        attached = AttachedLog.run([sys.executable, {str(fake_llama)!r}, {str(SPLIT)!r}, {str(record)!r}, "trap"])
        while not Path({str(record)!r} + ".done").exists():
            time.sleep(0.02)
        print(attached.pid)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    wait_for(lambda: not alive(int(done.stdout)), timeout=5, what="the child's end")
    assert Path(f"{record}.term").exists()


def test_a_missing_command_is_a_clear_error(tmp_path, capsys):
    temp = Path(tempfile.gettempdir())  # where a default passthrough file would be left
    left = set(temp.glob("kvscope-no-such-*")) | set(temp.glob("kvscope-not-here-*"))
    out = tmp_path / "run.kvtrace"
    assert main(["attach", "-o", str(out), "--", "no-such-llama-server-here", "-m", "m.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: attach: no such command: 'no-such-llama-server-here' (not found on PATH)"
    assert not out.exists()  # nothing was recorded: no file left
    with pytest.raises(KvscopeError, match="no such command: './not-here'$"):
        AttachedLog.run(["./not-here"])
    assert set(temp.glob("kvscope-no-such-*")) | set(temp.glob("kvscope-not-here-*")) == left


# ---- text frames without a terminal ---------------------------------------------------------------------------
def test_text_frames_of_a_saved_log_end_at_its_end(tmp_path):
    proc = kvscope("--log", str(SERVER), cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    text = stdout.decode()
    assert text.startswith(LEGEND)
    frames = text.split("\n=== ")[1:]
    assert frames and "finished: " in frames[-1] and "76 dumps (0 dropped to keep up)" in frames[-1]
    direct = parsed_directly(SERVER.read_bytes())[0]
    for name, cache in direct.caches.items():  # the last frame draws the final cells of every stream
        for s, st in enumerate(cache.streams):
            head = f"{name} · window 16 · " if name == "swa" else f"{name} · full attention · "
            assert f"{head}stream {s} · used {int((st.pos >= 0).sum())}/{cache.size} · head {st.head}" in frames[-1]


def test_text_frames_of_a_command_stop_after_seconds_and_end_it(tmp_path, fake_llama):
    record = tmp_path / "child.json"
    proc = kvscope("--seconds", "3", "--plain-every", "0.5", "--", sys.executable, str(fake_llama), str(UNIFIED),
                   str(record), "wait", cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    child = json.loads(record.read_text())["pid"]
    assert not alive(child)
    frames = stdout.decode().split("\n=== ")[1:]
    assert len(frames) >= 2 and "exited: " in frames[-1] and "ended by kvscope (killed by SIGTERM)" in frames[-1]
    assert "kv · full attention · stream 0 · used " in frames[-1]


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux's script for a terminal")
def test_in_a_terminal_the_explorer_opens_after_saying_what_was_added(tmp_path, fake_llama):
    pytest.importorskip("textual", reason="the terminal explorer needs the tui extra")
    record = tmp_path / "child.json"
    command = shlex.join([sys.executable, "-m", "kvscope.launcher", "attach", "--seconds", "3", "--", sys.executable,
                          str(fake_llama), str(SERVER), str(record), "wait"])
    shown = tmp_path / "terminal.out"
    done = subprocess.run(["script", "-qfec", command, str(shown)], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, shown.read_bytes()[-2000:]
    text = shown.read_bytes().decode(errors="replace")
    explorer_at = text.index("\x1b[?1049h")  # the explorer takes the screen
    assert 0 <= text.index("kvscope attach: added LLAMA_KV_CACHE_DEBUG=3, -v") < explorer_at
    assert "ended by kvscope (killed by SIGTERM)" in text[explorer_at:]
    assert not alive(json.loads(record.read_text())["pid"])


# ---- the notebook explorer ------------------------------------------------------------------------------------
def test_explorer_attach_watches_without_controls_and_ends_its_process(tmp_path, fake_llama):
    pytest.importorskip("ipywidgets", reason="the notebook explorer needs the jupyter extra")
    from explorer import Explorer

    x = Explorer.attach(SERVER)
    try:
        assert x.source.kind == "attached" and not x.source.live
        assert x.controls is None and x.settings is None and x._ticker is not None  # watched, never driven
        assert x.source.attached.wait(30)
        x.update()
        assert "finished" in x.status.value and "llama-server" in x.header.value
        assert picture_differences(parsed_directly(SERVER.read_bytes())[0], x.source.watcher.mirror) == []
    finally:
        x.close()
    record = tmp_path / "child.json"
    y = Explorer.attach(command=[sys.executable, str(fake_llama), str(SPLIT), str(record), "wait"],
                        passthrough=tmp_path / "pass.log")
    attached = y.source.attached
    wait_for(lambda: record.exists(), what="the child")
    y.close()
    assert attached.ended_by_kvscope and not alive(attached.pid)
    with pytest.raises(KvscopeError, match="give a log file or a command to run, one of the two"):
        Explorer.attach()
