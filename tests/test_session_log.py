"""A session's log: what the engine logs while it works for a session (llama.cpp's "context full, swapping:
..." from its worker) is kept in session.log, not written on stderr into whatever a notebook shows next,
unless the session is verbose; each session gets the lines of its own thread only; handlers the
application configured (the kvscope command's, pytest's) still get every line."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

import engine
from engine.errors import ArgumentTypeError, KvscopeError
from engine.runners.session import Session
from engine.runners.session_log import LOG_LEVELS
from engine.runners.workloads import WorkloadSpec

SHIFTING = dict(settings=dict(n_ctx=32, pad=32, n_seq_max=1, kv_unified=True),
                workload=WorkloadSpec("generate", n_predict=40, context_shift=True, sampler=dict(temperature=0.0)))
SWAP_LINE = "context full, swapping: n_past = 31"

# A script as a notebook runs it: no logging configured, so Python's last resort would print WARNING lines.
SCRIPT = """
    import json, logging, sys
    from engine.runners.session import Session
    from engine.runners.workloads import WorkloadSpec

    session = Session("demo", settings=dict(n_ctx=32, pad=32, n_seq_max=1), threads=1,
                      workload=WorkloadSpec("generate", n_predict=40, context_shift=True),
                      verbose=sys.argv[1] == "verbose")
    session.add_prompt("And God said").result()
    session.step(40).result()  # on the worker, which shifts the context once
    level_while_open = logging.getLogger("kvscope").level
    logging.getLogger("kvscope.script").warning("a line of no session")  # as before: on stderr
    logging.getLogger("kvscope.script").info("an info line of no session")  # as before: nowhere
    session.close()
    print(json.dumps(dict(warnings=[line.text for line in session.log.lines(level="warning")],
                          infos=[line.text for line in session.log.lines(level="info")],
                          level_while_open=level_while_open, level_after=logging.getLogger("kvscope").level)))
"""


def run_scripts(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Side by side: each loads torch and the demo model."""
    processes = [subprocess.Popen([sys.executable, "-c", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for argv in argvs]
    outputs = [p.communicate(timeout=240) for p in processes]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


def test_a_script_session_keeps_its_log_off_stderr_unless_verbose():
    cli_after_a_session = textwrap.dedent("""
        import sys
        from engine.runners.session import Session
        from engine.cli import main
        session = Session("demo")  # the router is on kvscope's loggers now
        sys.exit(main(["generate", "-m", "demo", "-p", "And God said", "-n", "40", "-c", "32", "--pad", "32",
                       "--context-shift", "--temp", "0"]))
    """)
    quiet, verbose, cli = run_scripts([textwrap.dedent(SCRIPT), "quiet"], [textwrap.dedent(SCRIPT), "verbose"],
                                      [cli_after_a_session])
    for done in (quiet, verbose):
        assert done.returncode == 0, done.stderr
        kept = json.loads(done.stdout)
        assert any(SWAP_LINE in text for text in kept["warnings"]), kept
        assert any(text.startswith("load_tensors:") for text in kept["infos"]), kept  # the load ran on the worker
        # nobody configured logging: the session's info lines are made while it is open, and only then
        assert (kept["level_while_open"], kept["level_after"]) == (logging.INFO, logging.NOTSET)
    assert quiet.stderr == "a line of no session\n"
    assert SWAP_LINE in verbose.stderr and "load_tensors:" in verbose.stderr
    assert verbose.stderr.endswith("a line of no session\n") and "an info line of no session" not in verbose.stderr
    # the kvscope command prints the engine's lines as llama.cpp does, each once
    assert cli.returncode == 0, cli.stderr
    assert cli.stderr.count(SWAP_LINE) == 1, cli.stderr


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


def texts(session: Session, level: str = "debug") -> list[str]:
    return [line.text for line in session.log.lines(level=level)]


def test_each_session_keeps_the_lines_of_its_own_thread(demo, caplog):
    say = logging.getLogger("kvscope.test").warning
    with Session(demo, **SHIFTING) as shifting, Session(demo) as idle, Session(demo, threaded=False) as by_hand:
        shifting.add_prompt("And God said").result()
        generated = shifting.step(40)
        idle.call(lambda: say("for the idle session's worker")).result()
        by_hand.call(lambda: say("for the session stepped by hand"))  # on this thread, inside its command
        say("for no session")
        generated.result()
        assert any(SWAP_LINE in text for text in texts(shifting, "warning"))
        assert texts(idle, "warning") == ["for the idle session's worker"]
        assert texts(by_hand, "warning") == ["for the session stepped by hand"]
        assert not any("for" in text for text in texts(shifting))
    # pytest's handler, one the application configured, got every line, the sessions' included
    said = [r.getMessage() for r in caplog.records]
    assert {"for the idle session's worker", "for the session stepped by hand", "for no session"} <= set(said)
    assert any(SWAP_LINE in message for message in said)


def test_the_level_says_which_lines_a_session_keeps(demo, caplog):
    caplog.set_level(logging.DEBUG, logger="kvscope")  # here pytest listens, so the session leaves levels alone
    say = logging.getLogger("kvscope.test")
    with Session(demo, log_level="warning") as session:
        session.call(lambda: (say.info("an info line"), say.warning("a warning"), say.error("an error"))).result()
        assert texts(session) == ["a warning", "an error"]
        session.log.level = "debug"
        session.call(lambda: (say.debug("a debug line"), say.exception("failed", exc_info=ValueError("bad")))).result()
        assert texts(session, "warning") == ["a warning", "an error", "failed: ValueError: bad"]
        lines = session.log.lines()
        assert [line.level for line in lines] == ["warning", "error", "debug", "error"]
        assert [line.number for line in lines] == [1, 2, 3, 4] and session.log.n_lines == 4
        assert [line.text for line in session.log.lines(after=3)] == ["failed: ValueError: bad"]
        assert lines[0].logger == "kvscope.test"
    assert set(LOG_LEVELS) == {"debug", "info", "warning", "error"}


def test_bad_log_arguments_are_refused(demo):
    with pytest.raises(KvscopeError, match="log level must be one of debug, info, warning, error"):
        Session(demo, log_level="loud")
    with pytest.raises(ArgumentTypeError, match="verbose must be True or False"):
        Session(demo, verbose="yes")
    with Session(demo) as session, pytest.raises(KvscopeError, match="got 'trace'"):
        session.log.level = "trace"
