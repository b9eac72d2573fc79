"""`kvscope serve` against hostile clients, local ones included (issue 27, point 2): a token always, the
paths a client names confined to the folders the server was given, message and state sizes capped.
Servers run in this process, on one demo session; each test checks the filesystem, not only the error."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import zmq

from engine.errors import KvscopeError
from engine.models.model import DEMO_MODEL_PATH
from engine.runners.confined_paths import ConfinedFolder
from engine.runners.serve import SessionServer
from engine.runners.session import Session
from engine.watch.protocol import PathRefusedError, pack_value, unpack_value
from engine.watch.remote import RemoteAccessError, RemoteSession, RemoteSessionError
from tests.test_remote import free_port_pair

REPLY_WAIT_MS = 10_000


@pytest.fixture(scope="module")
def session():
    with Session("demo", settings=dict(n_ctx=128, n_seq_max=2, kv_unified=True), workload="generate") as served:
        yield served


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    """RemoteSession and SessionServer read KVSCOPE_TOKEN; a developer's own must not change these tests."""
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)


@contextlib.contextmanager
def serve(session, bind: str = "127.0.0.1", **options):
    server = SessionServer(bind, free_port_pair(bind, set()), **options)
    try:
        server.start(session)
        yield server
    finally:
        server.close()


def client(server: SessionServer, **options) -> RemoteSession:
    options.setdefault("token", server.token)
    return RemoteSession(server.command_address, timeout=10, **options)


def error_of(future) -> str:
    with pytest.raises(KvscopeError) as caught:
        future.result(30)
    return f"{type(caught.value).__name__}: {caught.value}"


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def raw_dealer(server: SessionServer) -> tuple[zmq.Context, zmq.Socket]:
    """A client that speaks ZeroMQ but not kvscope's rules: what a hostile local user can open."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.command_address)
    return context, dealer


# ---- the token ----------------------------------------------------------------------------------------
def test_a_server_makes_up_a_token_also_when_it_listens_on_this_machine_only():
    first = SessionServer("127.0.0.1", free_port_pair("127.0.0.1", set()))
    second = SessionServer("127.0.0.1", free_port_pair("127.0.0.1", set()))
    try:
        assert isinstance(first.token, str) and len(first.token) >= 20
        assert first.token != second.token
        assert any(first.token in line for line in first.access_lines())
    finally:
        first.close()
        second.close()


def test_commands_without_the_token_are_refused_on_this_machine(session):
    with serve(session) as server:
        with client(server, token=None) as anonymous:
            assert "KVSCOPE_TOKEN" in error_of(anonymous.start())
            with pytest.raises(RemoteAccessError, match="takes commands only with its token"):
                anonymous.subscribe()
        with client(server, token="not-" + server.token) as wrong:
            assert "wrong token" in error_of(wrong.engine_cells())
        with client(server) as trusted:
            assert "base" in trusted.engine_cells().result(30)
        assert server.refused == 3


def test_the_token_can_come_from_the_environment(session, monkeypatch):
    """Not on the command line, where `ps` shows it to every user of the machine."""
    monkeypatch.setenv("KVSCOPE_TOKEN", "a-token-from-the-environment-0123")
    with serve(session) as server:
        assert server.token == "a-token-from-the-environment-0123"
        with RemoteSession(server.command_address, timeout=10) as remote:  # reads it too
            assert "base" in remote.engine_cells().result(30)


def test_no_token_is_refused_unless_the_server_listens_on_this_machine_only(session, caplog):
    with pytest.raises(KvscopeError, match="--no-token only with --bind 127.0.0.1"):
        SessionServer("0.0.0.0", free_port_pair("0.0.0.0", set()), no_token=True)
    with pytest.raises(KvscopeError, match="--token and --no-token"):
        SessionServer("127.0.0.1", free_port_pair("127.0.0.1", set()), token="chosen-token-0123456789", no_token=True)
    with caplog.at_level(logging.WARNING, logger="kvscope.serve"), serve(session, no_token=True) as server:
        assert server.token is None
        assert "--no-token: every user of this machine can drive this session" in caplog.text
        with client(server) as anyone:
            assert "base" in anyone.engine_cells().result(30)


def test_a_refused_or_broken_request_learns_nothing_of_the_session(session):
    """Garbage and tokenless requests from a raw socket: each gets an error, none the session's status."""
    with serve(session) as server:
        context, dealer = raw_dealer(server)
        try:
            garbage = [[b""], [b"\xc1\xc1"], [pack_value([1, 2])], [pack_value({"v": 1})], [b"two", b"frames"],
                       [pack_value({"v": 1, "id": 7, "token": None, "cmd": "status", "args": [], "kwargs": {}})],
                       [pack_value({"v": 1, "id": 8, "token": 12, "cmd": "status", "args": [], "kwargs": {}})]]
            for frames in garbage:
                dealer.send_multipart(frames)
                assert dealer.poll(REPLY_WAIT_MS), f"no reply to {frames!r}"
                header = unpack_value(dealer.recv_multipart()[0])
                assert header["ok"] is False and header["status"] is None and header["stamp"] == -1, frames
        finally:
            context.destroy(linger=0)
        with client(server) as trusted:
            assert "base" in trusted.engine_cells().result(30)


# ---- the state folder ----------------------------------------------------------------------------------
def test_save_state_writes_inside_the_state_folder_only(session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default state folder: kvscope-state/ in the current folder
    outside = tmp_path / "outside"
    outside.mkdir()
    with serve(session) as server:
        states = tmp_path / "kvscope-state"
        assert server.state_dir == states and not states.exists()  # made on first use, not at start
        with client(server) as remote:
            size = remote.save_state("run.state").result(30)
            assert (states / "run.state").stat().st_size == size > 0
            assert states.stat().st_mode & 0o777 == 0o700 and (states / "run.state").stat().st_mode & 0o777 == 0o600
            (states / "escape").symlink_to(outside, target_is_directory=True)
            (states / "dangling.state").symlink_to(outside / "made-by-a-link.state")
            (states / "latest.state").symlink_to("run.state")  # a link that stays inside is followed
            refused = {name: error_of(remote.save_state(name))
                       for name in (str(outside / "absolute.state"), "../outside/dotdot.state", "escape/linked.state",
                                    "dangling.state", "sub/../../outside/nested.state", "", ".")}
            assert remote.save_state("latest.state").result(30) == size
            assert remote.load_state("latest.state").result(30) == size
        assert files_under(outside) == set()
        assert files_under(states) == {"run.state", "escape", "dangling.state", "latest.state"}
        assert (states / "latest.state").is_symlink()
    for name, error in refused.items():
        assert error.startswith("PathRefusedError: save_state: refused"), (name, error)
    assert "absolute" in refused[str(outside / "absolute.state")]
    assert "'..'" in refused["../outside/dotdot.state"] and "'..'" in refused["sub/../../outside/nested.state"]
    assert "a symbolic link leads out" in refused["escape/linked.state"]
    assert "a symbolic link leads out" in refused["dangling.state"]


def test_a_link_swapped_in_after_the_check_is_not_followed(tmp_path, monkeypatch):
    """Someone who may write in the state folder turns a folder into a link to the owner's home between the
    check of a name and the write: the write goes nowhere, rather than through the link."""
    states, home = tmp_path / "states", tmp_path / "home"
    (states / "sub").mkdir(parents=True)
    home.mkdir()
    (home / ".bashrc").write_text("the owner's\n")
    folder = ConfinedFolder(states, "state folder", "--state-dir")
    checked = folder.resolve

    def checked_then_swapped(name, command):
        real = checked(name, command)
        (states / "sub").rename(states / "sub-before")
        (states / "sub").symlink_to(home, target_is_directory=True)
        return real

    monkeypatch.setattr(folder, "resolve", checked_then_swapped)
    with pytest.raises(PathRefusedError, match="save_state: cannot write 'sub/.bashrc' in the state folder"):
        folder.write_bytes("sub/.bashrc", b"written through a link", "save_state")
    assert (home / ".bashrc").read_text() == "the owner's\n" and files_under(home) == {".bashrc"}


def test_a_link_at_the_name_itself_is_replaced_not_written_through(tmp_path, monkeypatch):
    states, home = tmp_path / "states", tmp_path / "home"
    states.mkdir()
    home.mkdir()
    (home / ".bashrc").write_text("the owner's\n")
    folder = ConfinedFolder(states, "state folder", "--state-dir")
    checked = folder.resolve

    def checked_then_linked(name, command):
        real = checked(name, command)
        (states / name).symlink_to(home / ".bashrc")
        return real

    monkeypatch.setattr(folder, "resolve", checked_then_linked)
    assert folder.write_bytes("run.state", b"state", "save_state") == 5
    assert (home / ".bashrc").read_text() == "the owner's\n"
    assert not (states / "run.state").is_symlink() and (states / "run.state").read_bytes() == b"state"
    assert files_under(states) == {"run.state"}


def test_a_missing_subfolder_of_the_state_folder_is_named(session, tmp_path):
    with serve(session, state_dir=tmp_path) as server, client(server) as remote:
        error = error_of(remote.save_state("no-such-folder/run.state"))
    assert f"cannot write 'no-such-folder/run.state' in the state folder {tmp_path}" in error
    assert files_under(tmp_path) == set()


def test_a_given_state_folder_must_exist(tmp_path):
    with pytest.raises(KvscopeError, match=f"--state-dir {tmp_path / 'nowhere'}: no such folder"):
        SessionServer("127.0.0.1", free_port_pair("127.0.0.1", set()), state_dir=tmp_path / "nowhere")


def test_probing_files_outside_the_folders_gets_the_same_error_whether_they_exist_or_not(session, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "kvscope-state").mkdir()
    (tmp_path / "kvscope-state" / "escape").symlink_to(outside, target_is_directory=True)
    with serve(session) as server, client(server) as remote:
        (outside / "real.state").write_bytes(remote.save_state().result(30))
        (outside / "real.json").write_text("{}")
        probes = {"load_state": lambda path: remote.load_state(path),
                  "load_model": lambda path: remote.load_model(path),
                  "chat": lambda path: remote.set_workload("server", n_clients=1, chat=path)}
        for command, probe in probes.items():
            suffix = ".json" if command == "chat" else ".state"
            for form in (str(outside / "NAME"), "../outside/NAME", "escape/NAME"):
                real, missing = (error_of(probe(form.replace("NAME", stem + suffix))) for stem in ("real", "missing"))
                assert real.replace("real", "missing") == missing, (command, form, real, missing)
                assert "refused" in real, (command, form, real)
        assert remote.status().workload == "generate"


def test_a_chat_script_is_read_from_the_state_folder(session, tmp_path):
    (tmp_path / "chat.json").write_text("{}")
    with serve(session, state_dir=tmp_path) as server, client(server) as remote:
        error = error_of(remote.set_workload({"kind": "server", "n_clients": 1, "chat": "chat.json"}))
    assert f"{tmp_path / 'chat.json'}: expected an object" in error


# ---- the models folder ---------------------------------------------------------------------------------
def test_load_model_without_a_models_folder_takes_only_the_demo_model(session):
    with serve(session) as server, client(server) as remote:
        error = error_of(remote.load_model(str(DEMO_MODEL_PATH)))
        assert error.startswith("PathRefusedError: load_model: refused") and "--models-dir" in error
        remote.load_model("demo").result(60)
    assert session.model.path == str(DEMO_MODEL_PATH)


def test_load_model_is_confined_to_the_models_folder(session, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(DEMO_MODEL_PATH, models / "copy.gguf")
    (models / "escape.gguf").symlink_to(DEMO_MODEL_PATH)
    with serve(session, models_dir=models) as server, client(server) as remote:
        for name in (str(DEMO_MODEL_PATH), f"../../{DEMO_MODEL_PATH}", "escape.gguf"):
            assert error_of(remote.load_model(name)).startswith("PathRefusedError: load_model: refused"), name
        remote.load_model("copy.gguf").result(60)
        assert session.model.path == str(models / "copy.gguf")
        remote.load_model("demo").result(60)


def test_a_given_models_folder_must_exist(tmp_path):
    with pytest.raises(KvscopeError, match=f"--models-dir {tmp_path / 'nowhere'}: no such folder"):
        SessionServer("127.0.0.1", free_port_pair("127.0.0.1", set()), models_dir=tmp_path / "nowhere")


# ---- sizes -------------------------------------------------------------------------------------------------
def test_a_state_upload_over_the_cap_is_refused_and_changes_nothing(session):
    with serve(session, max_state_bytes=1024) as server, client(server) as remote:
        before = remote.engine_cells().result(30)
        error = error_of(remote.load_state(b"\0" * 2048))
        assert "load_state: the state sent is 2048 bytes; this server takes states of at most 1024 bytes" in error
        assert remote.engine_cells().result(30) == before


def test_a_message_over_the_size_limit_disconnects_its_sender_and_the_server_goes_on(session):
    with serve(session, max_state_bytes=4096) as server:
        assert 4096 < server.max_message_bytes < 1 << 20
        context, dealer = raw_dealer(server)
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            dealer.send(b"\0" * (server.max_message_bytes + 1))
            assert monitor.poll(REPLY_WAIT_MS), "ZeroMQ did not disconnect the sender of an oversized message"
        finally:
            dealer.disable_monitor()
            context.destroy(linger=0)
        assert server.serving
        with client(server) as trusted:
            assert "base" in trusted.engine_cells().result(30)


def test_a_client_refuses_to_send_what_the_server_would_drop(session):
    """The server tells its message limit in its heartbeats: a client says what is wrong instead of being
    disconnected."""
    with serve(session, max_state_bytes=4096) as server, client(server) as remote:
        deadline = time.monotonic() + 10
        while not remote.connected:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.02)
        with pytest.raises(RemoteSessionError, match=f"at most {server.max_message_bytes} bytes"):
            remote.load_state(b"\0" * (server.max_message_bytes + 1)).result(30)
        assert remote.connected and "base" in remote.engine_cells().result(30)


def test_a_hostile_client_touches_nothing_outside_the_folders(session, tmp_path, monkeypatch):
    """A raw socket with the token (a client that knows it but not the rules) naming paths of its choosing."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("the owner's\n")
    with serve(session) as server:
        context, dealer = raw_dealer(server)
        try:
            requests = [("save_state", [str(home / ".bashrc")], {}), ("save_state", [], {"path": "../home/.bashrc"}),
                        ("load_state", [str(home / ".bashrc")], {}), ("load_model", [str(home)], {}),
                        ("save_state", [str(home / ".bashrc"), None], {}), ("load_state", [["a", "list"]], {}),
                        ("set_workload", [{"kind": "server", "chat": str(home / ".bashrc")}], {})]
            for req_id, (cmd, args, kwargs) in enumerate(requests):
                dealer.send(pack_value({"v": 1, "id": req_id, "token": server.token, "cmd": cmd, "args": args,
                                        "kwargs": kwargs}))
                assert dealer.poll(REPLY_WAIT_MS), cmd
                header = unpack_value(dealer.recv_multipart()[0])
                assert header["ok"] is False and header["id"] == req_id, (cmd, args, kwargs, header)
        finally:
            context.destroy(linger=0)
    assert (home / ".bashrc").read_text() == "the owner's\n" and files_under(home) == {".bashrc"}
    assert not (tmp_path / "kvscope-state").exists() or files_under(tmp_path / "kvscope-state") == set()
    assert os.listdir(tmp_path) in (["home"], sorted(["home", "kvscope-state"]))
