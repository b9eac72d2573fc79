"""`kvscope record -o FILE generate|parallel ...` runs the command with a recorder on its context's bus."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import pytest

from engine.cli import main
from engine.watch.recording import RecordingReader

SUMMARY = re.compile(r"kvscope record: wrote (\d+) events, (\d+) keyframes, (\d+) bytes to (.+)")


def record(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", "record", *args], capture_output=True, text=True,
                          timeout=600)


def summary(stderr: str) -> tuple[int, int, int, str]:
    match = SUMMARY.search(stderr)
    assert match, stderr[-2000:]
    return int(match[1]), int(match[2]), int(match[3]), match[4]


def test_record_parallel_end_to_end(tmp_path):
    path = tmp_path / "run.kvtrace"
    done = record(["-o", str(path), "--keyframe-every", "60", "parallel", "-np", "2", "-ns", "3", "-n", "8",
                   "-c", "384", "--pad", "32", "--seed", "1", "--temp", "0"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Client" in done.stdout  # the command's own output is unchanged
    n_events, n_keyframes, n_bytes, where = summary(done.stderr)
    assert where == str(path) and path.stat().st_size == n_bytes
    with RecordingReader(path) as rec:
        assert (len(rec), len(rec.keyframes)) == (n_events, n_keyframes) and n_keyframes == n_events // 60
        assert not rec.truncated
        assert rec.info["command"] == "parallel" and rec.info["settings"]["parallel"] == 2
        assert rec.info["keyframe_every"] == 60 and rec.info["writer"].startswith("kvscope ")
        kinds = Counter(e.kind for e in rec.events())
        end = rec.mirror_at(-1)
    assert kinds["SequenceAssigned"] == 3 and kinds["ContextCreated"] == 2 and kinds["Vocabulary"] == 1
    assert sorted(end.caches) == ["base", "swa"] and end.n_stream("base") == 3  # -np 2 and the system prompt
    assert end.devices.placement is not None and end.vocabulary is not None


def test_record_generate_end_to_end(tmp_path):
    path = tmp_path / "gen.kvtrace"
    done = record(["-o", str(path), "generate", "-p", "And God said", "-n", "6", "-c", "256", "--pad", "32",
                   "--seed", "1", "--temp", "0"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("And God said")
    n_events, _, _, _ = summary(done.stderr)
    with RecordingReader(path) as rec:
        events = list(rec.events())
        end = rec.mirror_at(-1)
    assert len(events) == n_events
    placed = sum(e.n_tokens for e in events if e.kind == "DecodeFinished" and e.rc == 0)
    positions = sorted(pos for pos, seqs, _ in end.cells(0, "base") if 0 in seqs)
    assert positions == list(range(placed))  # the cells hold every decoded token of sequence 0


def test_record_errors_name_what_is_wrong(tmp_path, capsys):
    assert main(["record", "-o", str(tmp_path / "nodir" / "x.kvtrace"), "generate", "-n", "1"]) == 1
    assert "nodir/x.kvtrace: cannot create the recording" in capsys.readouterr().err
    assert main(["record", "-o", str(tmp_path / "k.kvtrace"), "--keyframe-every", "0", "generate"]) == 1
    assert "--keyframe-every must be >= 1, got 0" in capsys.readouterr().err
    # a setting refused before the model loads: nothing was recorded, so no file is left behind
    assert main(["record", "-o", str(tmp_path / "np.kvtrace"), "generate", "-np", "0"]) == 1
    assert "-np must be >= 1" in capsys.readouterr().err and not (tmp_path / "np.kvtrace").exists()
    with pytest.raises(SystemExit):
        main(["record", "-o", str(tmp_path / "f.kvtrace"), "parallel", "--bogus"])
    err = capsys.readouterr().err
    assert "usage: kvscope record parallel" in err and "kvscope record parallel has no flag --bogus" in err
    with pytest.raises(SystemExit):
        main(["record", "generate"])
    assert "the following arguments are required: -o/--output" in capsys.readouterr().err
