"""`kvscope serve` and RemoteSession in two processes on this machine: a remote watcher equals the engine
after commands, a late one starts from the state, errors come back as the server's own, the token is
required (on this machine too), and killing either side leaves the other running with a clear status.
Hostile clients, paths and sizes: tests/test_serve_security.py."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import events as ev
from engine.errors import ArgumentTypeError, KvscopeError
from engine.watch.remote import (
    RemoteAccessError,
    RemoteSession,
    RemoteSessionError,
    RemoteSubscription,
)
from engine.watch.watcher import Watcher

REPO = Path(__file__).resolve().parents[1]
# Small and paused (steps only when asked), so that the engine's cells are stable when compared.
SERVE_FLAGS = ["-c", "256", "--pad", "32", "-np", "4", "-kvu", "--swa-full", "-ctk", "f32", "-ctv", "f32",
               "--workload", "generate", "-n", "12", "--temp", "0"]
START_TIMEOUT = 60


class Server:
    """A `kvscope serve` process; its stdout and stderr go to files, so that a full pipe never stalls it."""

    def __init__(self, tmp: Path, name: str, port: int, *flags: str, token: str | None = None) -> None:
        """token: given through KVSCOPE_TOKEN, so that a restarted server takes the same and clients reconnect
        by themselves (None: the server makes one up at each start)."""
        self.port, self.out, self.err = port, tmp / f"{name}.out", tmp / f"{name}.err"
        self.address = f"tcp://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), *SERVE_FLAGS, *flags]
        self.env = {**os.environ, "KVSCOPE_TOKEN": token} if token else None
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO,
                                         env=self.env)

    def wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while "ready" not in self.out.read_text():
            assert self.proc.poll() is None, f"kvscope serve exited with {self.proc.returncode}: {self.err.read_text()}"
            assert time.monotonic() < deadline, f"kvscope serve did not start: {self.err.read_text()}"
            time.sleep(0.05)
        return self.out.read_text()

    @property
    def token(self) -> str:
        """The token this run of the server printed (a restarted server makes up another)."""
        return re.findall(r"token: (\S+)", self.wait_ready())[-1]

    def client(self, timeout: float = 10) -> RemoteSession:
        return RemoteSession(self.address, token=self.token, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def free_port_pair(host: str, taken: set[int]) -> int:
    """A port p such that p and p + 1 are free on host (the command and the event port)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port >= 65534 or {port, port + 1} & taken:
            continue
        try:
            with socket.socket() as probe:
                probe.bind((host, port + 1))
        except OSError:
            continue
        taken |= {port, port + 1}
        return port
    raise AssertionError("no two free neighbouring ports")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Every server of this file, started together (each loads the model for seconds)."""
    tmp, taken = tmp_path_factory.mktemp("serve"), set()
    started = {"shared": Server(tmp, "shared", free_port_pair("127.0.0.1", taken)),
               "open": Server(tmp, "open", free_port_pair("0.0.0.0", taken), "--bind", "0.0.0.0"),
               "doomed": Server(tmp, "doomed", free_port_pair("127.0.0.1", taken), token="the-doomed-server-s-token")}
    yield started
    for server in started.values():
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)


@pytest.fixture
def shared(servers):
    """The shared server, paused, with a fresh generate workload and an empty cache."""
    server = servers["shared"]
    server.wait_ready()
    with server.client() as remote:
        remote.pause().result(30)
        remote.set_workload("generate", n_predict=12, sampler={"temperature": 0.0}).result(30)
        remote.clear().result(30)
    return server


def engine_view(remote: RemoteSession) -> dict:
    return remote.engine_cells().result(30)


def watch_equals(watcher: Watcher, engine: dict) -> bool:
    watcher.poll()
    if watcher.stale or set(watcher.mirror.caches) != set(engine):
        return False
    return all(watcher.mirror.cells(s, name) == cells and watcher.mirror.head(s, name) == view["heads"][s]
               for name, view in engine.items() for s, cells in enumerate(view["cells"]))


def wait_until(condition, timeout: float = 10, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_remote_watcher_equals_the_engine_after_commands(shared):
    with shared.client() as remote:
        watcher = Watcher.of(remote)
        seq = remote.add_prompt("And God said unto Moses").result(30)
        outcomes = remote.step(4).result(30)
        assert [o.phase for o in outcomes] == ["batch"] * 4 and outcomes[0].active_seqs == (seq,)
        copy = (seq + 1) % 4
        assert remote.seq_cp(seq, copy).result(30) is None
        assert remote.seq_rm(copy, 3, -1).result(30) is True
        assert remote.context_shift(seq, n_keep=1, n_discard=2).result(30) == 2
        remote.step(2).result(30)
        engine = engine_view(remote)
        wait_until(lambda: watch_equals(watcher, engine), what="the remote watcher to equal the engine")
        assert watcher.dropped == 0 and watcher.resyncs == 0
        done = [e.command for e in watcher.recent if isinstance(e, ev.CommandDone)]
        assert done[-6:] == ["add_prompt", "step", "seq_cp", "seq_rm", "context_shift", "step"]
        status = remote.status()
        assert status.state == "paused" and status.workload == "generate" and status.model == "kvscope-demo-gemma3"
        # the status comes with a command's reply, the WorkloadStep event on the event socket: wait for it
        wait_until(lambda: watcher.poll() >= 0 and status.step == max(
            e.step for e in watcher.recent if isinstance(e, ev.WorkloadStep)), what="the last step's event")


def test_a_late_watcher_gets_the_state_first(shared):
    with shared.client() as early:
        early.add_prompt("In the beginning").result(30)
    with shared.client() as late:
        engine = engine_view(late)
        sub = late.subscribe()
        state = sub.drain()
        kinds = [e.kind for e in state]
        assert {"ContextCreated", "Vocabulary", "MemorySnapshot", "SessionStatus"} <= set(kinds)
        assert len({e.seq_no for e in state}) == 1  # stamped with the last event published before it
        watcher = Watcher(sub, late.current_state)
        for event in state:
            watcher.apply(event)
        assert watch_equals(watcher, engine)  # at once: the state alone is the engine's
        assert watcher.status.state == "paused"


def test_errors_come_back_as_the_servers_own_and_bytes_travel(shared):
    with shared.client() as remote:
        with pytest.raises(ArgumentTypeError, match="seq_add: seq_id must be an int, got '0'"):
            remote.seq_add("0", 0, 1, 1).result(30)
        with pytest.raises(KvscopeError, match="seq 3 holds no cells"):
            remote.context_shift(3, 0).result(30)
        with pytest.raises(RemoteSessionError, match="unknown command 'explode'; a kvscope server takes add_prompt"):
            remote._call("explode").result(30)
        seq = remote.add_prompt("remember this").result(30)
        remote.step(1).result(30)  # the generate workload decodes a prompt at its next step
        data = remote.save_state(seq_id=seq).result(30)
        assert isinstance(data, bytes) and len(data) > 100
        assert remote.load_state(data, seq_id=2).result(30) == len(data)
        cells = engine_view(remote)["base"]["cells"][0]
        assert sorted(p for p, seqs, _ in cells if 2 in seqs) == sorted(p for p, seqs, _ in cells if seq in seqs)
        estimate = remote.estimate(n_ctx=512)
        assert estimate["n_ctx"] == 512 and estimate["model"] == "kvscope-demo-gemma3"


def test_a_slow_remote_watcher_resyncs_and_is_right_again(shared):
    with shared.client() as remote:
        slow = Watcher(remote.subscribe(maxsize=16), remote.current_state)
        remote.add_prompt("Let there be light").result(30)
        remote.step(6).result(30)
        engine = engine_view(remote)
        wait_until(lambda: watch_equals(slow, engine), what="the slow watcher to resync")
        assert slow.dropped > 0 and slow.resyncs >= 1


def test_events_lost_on_the_way_are_counted_and_told():
    """What PUB drops for a slow subscriber shows as a gap in seq_no (or after the last event a heartbeat
    names); a restarted server's events are numbered after every one seen. No server needed: the link's
    handlers are fed by hand, on its own thread."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with RemoteSession(f"tcp://127.0.0.1:{port}", timeout=10) as remote:
        link = remote._link
        sub = RemoteSubscription(link, 64, (ev.TokenSampled,))
        on_link = lambda call: link.run_future(call).result(10)
        on_link(lambda: (link.add(sub), link._heard(b"server 1"), sub._release([])))

        def arrive(seq_no: int) -> None:
            event = ev.TokenSampled(0, 7, "x", seq_no)
            object.__setattr__(event, "seq_no", seq_no)
            on_link(lambda: link._on_event(event))

        for seq_no in (0, 1, 2, 5, 6):
            arrive(seq_no)
        events = sub.drain()
        assert [(e.kind, e.seq_no) for e in events] == [("TokenSampled", 0), ("TokenSampled", 1), ("TokenSampled", 2),
                                                         ("EventsDropped", 5), ("TokenSampled", 5), ("TokenSampled", 6)]
        assert (events[3].count, events[3].first_seq_no, events[3].last_seq_no) == (2, 3, 4) and sub.dropped == 2
        on_link(lambda: (setattr(link, "_synced", link.instance), link._check_tail(8)))  # 7 and 8 never came
        assert sub.dropped == 4
        on_link(lambda: link._heard(b"server 2"))
        arrive(0)
        events = [e for e in sub.drain() if not isinstance(e, ev.SessionStatus)]
        assert [(e.kind, e.seq_no) for e in events] == [("EventsDropped", 9), ("EventsDropped", 9), ("TokenSampled", 9)]
        assert (events[0].count, events[0].last_seq_no) == (0, 9)  # the restart: what the watcher holds is gone
        assert (events[1].count, events[1].first_seq_no, events[1].last_seq_no) == (2, 7, 8)


def test_killing_a_client_leaves_the_server_serving(shared):
    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from engine.watch.remote import RemoteSession
        from engine.watch.watcher import Watcher
        remote = RemoteSession({shared.address!r}, token={shared.token!r})
        watcher = Watcher.of(remote)
        remote.add_prompt("a client about to die").result(30)
        print("ready", flush=True)
        while True:
            remote.step(1).result(30)
            watcher.poll()
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=REPO, text=True)
    try:
        assert client.stdout.readline().strip() == "ready", client.stderr.read()
    finally:
        client.kill()
        client.wait(timeout=30)
    with shared.client() as other:
        watcher = Watcher.of(other)
        other.step(2).result(30)
        engine = engine_view(other)
        wait_until(lambda: watch_equals(watcher, engine), what="the second client's watcher")
        assert other.status().state == "paused"
    assert shared.proc.poll() is None


def test_the_readme_remote_block_runs(shared):
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Remote"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    assert "tcp://gpu-box:5590" in code and 'token="..."' in code
    code = code.replace("tcp://gpu-box:5590", shared.address).replace('token="..."', f"token={shared.token!r}")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    remote, watcher = scope["remote"], scope["watcher"]
    try:
        wait_until(lambda: watcher.poll() >= 0 and watcher.last_step is not None, what="a step of the README's run")
        remote.pause().result(30)
        assert remote.status().state == "paused"
    finally:
        remote.close()


def test_commands_need_the_token_when_bound_off_this_machine(servers, monkeypatch):
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    server = servers["open"]
    token = server.token
    with RemoteSession(server.address, timeout=10) as anonymous:
        with pytest.raises(RemoteAccessError, match="takes commands only with its token"):
            anonymous.start().result(30)
        with pytest.raises(RemoteAccessError):
            anonymous.subscribe()
    with RemoteSession(server.address, token="not-" + token, timeout=10) as wrong, \
            pytest.raises(RemoteAccessError, match="wrong token"):
        wrong.engine_cells().result(30)
    with RemoteSession(server.address, token=token, timeout=10) as trusted:
        watcher = Watcher.of(trusted)
        trusted.add_prompt("with the token").result(30)
        engine = engine_view(trusted)
        wait_until(lambda: watch_equals(watcher, engine), what="the watcher with the token")
    assert server.stop(signal.SIGINT) == 0
    assert "stopped (SIGINT) after" in server.err.read_text() and "(3 refused)" in server.err.read_text()


def test_killing_the_server_fails_commands_and_the_client_reconnects(servers):
    server = servers["doomed"]
    server.wait_ready()
    with server.client(timeout=1.5) as remote:
        watcher = Watcher.of(remote)
        remote.add_prompt("soon gone").result(30)
        server.proc.kill()
        server.proc.wait(timeout=30)
        with pytest.raises(RemoteSessionError, match=f"no answer from {server.address}: the server is gone or busy"):
            remote.step(1).result(30)
        assert remote.status().state == "disconnected" and not remote.connected
        watcher.poll()
        assert watcher.status.state == "disconnected"
        server.start()
        server.wait_ready()
        wait_until(lambda: remote.connected, timeout=10, what="the client to reconnect")
        assert remote.add_prompt("back again").result(30) == 0  # a new server: an empty cache
        engine = engine_view(remote)
        wait_until(lambda: watch_equals(watcher, engine), what="the watcher to follow the new server")
        watcher.poll()  # the status that the client sends after the state the watcher resynced from
        assert watcher.resyncs == 1 and watcher.status.state == "paused"
    assert server.stop() == 0
    assert "stopped (SIGTERM)" in server.err.read_text()


def test_closing_after_the_io_thread_already_stopped_does_not_raise():
    """close() sets the stop flag, then wakes the I/O thread; a poll that times out in between ends the
    thread and closes its end of the wake pipe, so the wake finds no reader (zmq.Again). That is the
    thread being gone already, not an error: close() finishes and pending commands still fail."""
    import zmq

    from engine.watch.remote import RemoteSession, RemoteSessionError

    remote = RemoteSession("tcp://127.0.0.1:9", timeout=10)  # nothing listens there
    pending = remote.pause()
    link = remote._link
    link._stopping = True  # what close() does first; the thread sees it at its next poll timeout
    link._thread.join(timeout=10)
    assert not link._thread.is_alive()
    for _ in range(100):  # a wake or two may still be queued before zmq learns that the reader has gone
        try:
            link.run(lambda: None)
        except zmq.Again:
            break
        time.sleep(0.02)
    else:
        pytest.fail("the wake pipe never reported its reader gone")
    remote.close()
    assert link.closed
    with pytest.raises(RemoteSessionError):
        pending.result(5)
