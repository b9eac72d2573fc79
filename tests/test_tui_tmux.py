"""`kvscope` as a person starts it: in a real terminal (tmux) of the sizes people use (80x24, 120x40), with no
arguments, on the demo workload. The test waits for the grid to fill while generating, reads the screen as
tmux shows it (the keys to help and quit, the status line and the memory bars whole), opens the help screen
with `?`, and quits with `q`. A screenshot of the running explorer (the pane's colours, through
Rich's SVG export and Chromium) goes to $KVSCOPE_TUI_OUT when it is set (the README's picture comes from
there). Skips when tmux is missing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="no tmux on the PATH")
pytest.importorskip("textual", reason="the terminal explorer needs textual (the tui extra)")
KVSCOPE = Path(sys.executable).with_name("kvscope")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen(session: str, colours: bool = False) -> str:
    return tmux("capture-pane", "-p", *(["-e"] if colours else []), "-t", session)


def wait_for(session: str, predicate, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = screen(session)
        if predicate(text):
            return text
        time.sleep(0.25)
    raise AssertionError(f"{what} not seen within {timeout:.0f} s; the screen:\n{text}")


def step_of(text: str) -> int | None:
    match = re.search(r"step (\d+)", text)
    return int(match.group(1)) if match else None


@pytest.fixture(params=[(80, 24), (120, 40)], ids=lambda size: f"{size[0]}x{size[1]}")
def kvscope_in_tmux(tmp_path, request):
    if not KVSCOPE.exists():
        pytest.skip(f"the kvscope command is not installed beside {sys.executable}")
    session = f"kvscope-test-{uuid.uuid4().hex[:8]}"
    # COLUMNS and LINES (set by the test run) would override the pane's size for Textual (shutil reads them first)
    env = f"env -u COLUMNS -u LINES TERM=xterm-256color COLORTERM=truecolor HOME={tmp_path}"
    width, height = request.param
    tmux("new-session", "-d", "-s", session, "-x", str(width), "-y", str(height), f"{env} {KVSCOPE}; sleep 30")
    try:
        yield session, width
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_kvscope_runs_the_demo_in_a_terminal_and_quits(kvscope_in_tmux):
    session, width = kvscope_in_tmux
    first = wait_for(session, lambda t: "base" in t and "swa" in t and (step_of(t) or 0) >= 1, 90,
                     "the demo's lanes and a first step")
    later = wait_for(session, lambda t: (step_of(t) or 0) >= step_of(first) + 5, 60, "five more steps")
    assert "█" in later, "sequences' cells are drawn"
    assert re.search(r"weights", later), "the device bars are on screen"
    lines = later.splitlines()
    keys, status = lines[-1], lines[-2]
    assert "? help" in keys and "q quit" in keys and "space start/pause" in keys, keys
    assert re.match(r" (running|idle|paused)  step \d+", status) and "base " in status and "swa " in status, status
    assert re.search(r"\d+\.\d MiB", later) and re.search(r"no limit|of \d", later), "the memory figures"
    assert not any(re.search(r"│ (limit|MiB)\b", line) for line in lines), "a memory figure wrapped in two"
    out = os.environ.get("KVSCOPE_TUI_OUT") if width >= 120 else None
    if out:  # a later step, when the window has slid and clients have finished and been shifted
        wait_for(session, lambda t: (step_of(t) or 0) >= 60, 90, "step 60")
        save_screenshot(screen(session, colours=True), Path(out))

    tmux("send-keys", "-t", session, "?")
    help_screen = wait_for(session, lambda t: "kvscope shows a KV cache" in t, 20, "the help screen")
    assert "pending shift" in help_screen and "the head" in help_screen
    tmux("send-keys", "-t", session, "Escape")
    wait_for(session, lambda t: "kvscope shows a KV cache" not in t and "base" in t, 20, "the main screen again")

    tmux("send-keys", "-t", session, "q")
    # the command has ended when the pane shows the shell's `sleep` and no explorer any more
    wait_for(session, lambda t: "swa" not in t, 30, "kvscope to quit")


def save_screenshot(ansi: str, out: Path) -> None:
    """The pane as an SVG (Rich reads tmux's escape codes) and, with Chromium, a PNG."""
    from rich.console import Console
    from rich.text import Text

    out.mkdir(parents=True, exist_ok=True)
    console = Console(record=True, width=120, file=open(os.devnull, "w"), color_system="truecolor")
    console.print(Text.from_ansi(ansi.rstrip("\n")), soft_wrap=True)
    svg = out / "tui.svg"
    svg.write_text(console.export_svg(title="kvscope"), encoding="utf-8")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={out / 'tui.png'}",
                        "--window-size=1480,1000", "--hide-scrollbars", svg.as_uri()], capture_output=True, timeout=60)
