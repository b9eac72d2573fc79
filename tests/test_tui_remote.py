"""The explorer on a remote session: `kvscope serve` in a subprocess, the TUI driving it through
RemoteSession as a person would; the grid equals the server's cells, a server that dies is shown as
disconnected (and retried), and one that comes back on the same address is shown again."""
from __future__ import annotations

import signal

import pytest

from engine.watch.frames import EMPTY, SHARED
from engine.watch.remote import RemoteSession
from engine.watch.sources import remote_source
from tests.test_remote import Server, free_port_pair
from tui.app import KvscopeApp
from tui.grid import CellGrid
from tui.screens import PromptScreen
from tui.status import StatusLine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def grid_equals(app: KvscopeApp, cells: dict) -> bool:
    lanes = app.query_one(CellGrid).lanes
    if {lane.cache for lane in lanes} != set(cells):
        return False
    for lane in lanes:
        engine = cells[lane.cache]["cells"][lane.stream]
        owners = [EMPTY if not s else (min(s) if len(s) == 1 else SHARED) for _, s, _ in engine]
        if lane.frame.pos.tolist() != [p for p, _, _ in engine] or lane.frame.owner.tolist() != owners:
            return False
    return True


async def until(pilot, condition, what: str, tries: int = 300) -> None:
    for _ in range(tries):
        pilot.app.refresh_view()
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status_text(app: KvscopeApp) -> str:
    return str(app.query_one(StatusLine).render())


async def test_the_explorer_drives_a_served_session_and_survives_its_restart(tmp_path):
    server = Server(tmp_path, "tui", free_port_pair("127.0.0.1", set()), token="the-tui-test-server-s-token")
    try:
        server.wait_ready()
        remote = RemoteSession(server.address, token=server.token, timeout=5)
        app = KvscopeApp(remote_source(remote, label=server.address))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("p")
            assert isinstance(app.screen, PromptScreen)
            await pilot.press(*"In the beginning", "enter")
            await pilot.press("n", "n", "n")
            await until(pilot, lambda: remote.status().step >= 3, "three steps on the server")
            await until(pilot, lambda: grid_equals(app, remote.engine_cells().result(30)), "the server's cells")
            assert app.query_one(CellGrid).lanes[0].frame.used > 0

            server.stop(signal.SIGKILL)
            await until(pilot, lambda: "disconnected" in status_text(app), "the lost connection in the status line")
            assert "retrying" in status_text(app)

            server.start()  # another server on the same address: an empty cache
            server.wait_ready()
            await until(pilot, lambda: remote.connected, "the reconnection")
            await until(pilot, lambda: "disconnected" not in status_text(app), "the status line after reconnecting")
            await until(pilot, lambda: grid_equals(app, remote.engine_cells().result(30)), "the new server's cells")
            assert app.query_one(CellGrid).lanes[0].frame.used == 0
            await pilot.press("q")
        remote.close()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
