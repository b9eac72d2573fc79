"""The notebook explorer without a browser: its widgets' state after the same clicks and choices a person
makes, on a session stepped by hand (so every redraw has happened when a click returns)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("ipywidgets", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")
pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")

from engine.runners.demo import DEMO_SETTINGS, DEMO_WORKLOAD  # noqa: E402
from engine.runners.session import Session  # noqa: E402
from engine.sampling import SamplerParams  # noqa: E402
from engine.watch.describe import held_seqs  # noqa: E402
from engine.watch.recording import RecordingReader  # noqa: E402
from explorer import Explorer  # noqa: E402
from explorer.grid import ATTENTION, CELLS, EMPTY_BAND  # noqa: E402

WORKLOAD = dataclasses.replace(DEMO_WORKLOAD, sampler=SamplerParams(temperature=0.0, seed=1))


def demo(**settings) -> Session:
    return Session("demo", settings={**DEMO_SETTINGS, **settings}, workload=WORKLOAD, threaded=False)


@pytest.fixture
def explorer():
    x = Explorer(demo(), columns=32)
    yield x
    x.close()


def grid_owners(x: Explorer, lane: int = 0) -> np.ndarray:
    size = x.grid._lanes[lane][2]
    return np.array(x.grid.trace(lane, CELLS).z, dtype=float).ravel()[:size]


def test_step_draws_the_cells_and_the_status(explorer):
    x = explorer
    assert (grid_owners(x) == EMPTY_BAND).all()
    x.controls.n_steps.value = 3
    x.controls.step.click()
    assert x.controls.message.value.endswith("3 steps done</span>")
    assert "step 3" in x.status.value and "base 0/256" not in x.status.value
    engine = x.session.engine_cells().result()["base"]["cells"][0]
    assert ((grid_owners(x) != EMPTY_BAND) == np.array([pos >= 0 for pos, _, _ in engine])).all()
    assert (grid_owners(x) != EMPTY_BAND).any()
    assert "kvscope-demo-gemma3" in x.header.value and "window 16" in x.header.value
    assert "DecodeFinished" in x.log.text.value


def test_a_sequence_operation_from_its_button_changes_the_grid(explorer):
    x = explorer
    x.session.step(12).result()
    assert "1" in x.seq_menu.options
    x.seq_menu.value = "1"
    assert x.selected_seq == 1 and x.window.figure.layout.title.text.startswith("seq 1: its next token")
    held = (grid_owners(x) == 1).sum()
    assert held > 0
    x.controls.ops["rm"].click()
    assert "seq 1 removed" in x.controls.message.value
    assert (grid_owners(x) == 1).sum() == 0 and 1 not in held_seqs(x.source.watcher.mirror)
    assert x.seq_menu.value == "1", "the selection stays on the removed sequence"
    assert x.window.figure.layout.title.text == "seq 1 holds no cell"

    x.seq_menu.value = "2"
    x.controls.ops["cp"].click()
    copied_to = int(x.controls.message.value.split("copied to seq ")[1].split("<")[0])
    assert copied_to not in (0, 2) and copied_to in held_seqs(x.source.watcher.mirror)


def test_bad_input_is_told_on_the_page_and_changes_nothing(explorer):
    x = explorer
    x.session.step(2).result()
    x.seq_menu.value = "none"
    x.controls.ops["keep"].click()
    assert "select a sequence first" in x.controls.message.value
    x.controls.prompt.value = "   "
    x.controls.add_prompt.click()
    assert "type a prompt first" in x.controls.message.value
    x.settings.fields["n_ctx"].value = "lots"
    assert x.settings.apply() is None
    assert "n_ctx: &#x27;lots&#x27; is not a whole number" in x.settings.estimate_text.value
    assert "settings not applied" in x.controls.message.value
    assert x.session.status().settings["n_ctx"] == 256


def test_settings_show_their_memory_first_and_apply_rebuilds(explorer):
    x = explorer
    x.settings.fields["n_ctx"].value = "512"
    assert x.settings.estimate()
    assert "fits: True" in x.settings.estimate_text.value and "K/V" in x.settings.estimate_text.value
    assert x.session.status().settings["n_ctx"] == 256, "the estimate changes nothing"
    x.settings.apply().result()
    assert x.session.status().settings["n_ctx"] == 512
    assert [size for _, _, size in x.grid._lanes] == [512, 512]
    assert "context rebuilt" in x.controls.message.value


def test_the_timeline_scrubs_the_live_history_and_returns(explorer):
    x = explorer
    x.session.step(6).result()
    live_used = int((grid_owners(x) != EMPTY_BAND).sum())
    x.timeline.seek(20)
    assert not x.timeline.live and x.grid.watcher is x.timeline.replay.watcher
    reader = RecordingReader(x.timeline.path)
    expected = reader.mirror_at(20).caches["base"].streams[0].pos
    assert ((grid_owners(x) != EMPTY_BAND) == (expected >= 0)).all()
    assert int((grid_owners(x) != EMPTY_BAND).sum()) < live_used
    assert x.timeline.slider.value == 21 and "event 21 of" in x.timeline.label.value
    assert "timeline at event 21" in x.header.value
    x.session.step(2).result()  # the session runs on; the scrubbed views stay where they are
    assert int((grid_owners(x) != EMPTY_BAND).sum()) < live_used
    x.timeline.kind.value = "decodes"
    found = x.timeline.jump(1)
    assert found is not None and "Decode" in x.timeline.label.value or "WorkloadStep" in x.timeline.label.value
    x.timeline.go_live()
    assert x.timeline.live and x.grid.watcher is x.source.watcher
    assert int((grid_owners(x) != EMPTY_BAND).sum()) >= live_used
    reader.close()


def test_the_event_log_filters_by_kind_sequence_and_cache(explorer):
    x = explorer
    x.session.step(8).result()
    x.log.group.value = "tokens"
    lines = x.log.text.value.split("<br>")
    assert lines and all("TokenSampled" in line or "SequenceAssigned" in line for line in lines)
    x.log.seq.value = "2"
    assert all("seq 2" in line for line in x.log.text.value.split("<br>"))
    x.log.group.value = "cells"
    x.log.seq.value = "any"
    x.log.cache.value = "swa"
    lines = x.log.text.value.split("<br>")
    assert lines and all(" swa " in line for line in lines)


def test_attention_is_laid_over_the_grid_of_the_selected_sequence():
    x = Explorer(demo(publish_attention=True), columns=32)
    try:
        x.session.step(4).result()
        x.seq_menu.value = "1"
        x.attention_box.value = True
        z = np.array(x.grid.trace(0, ATTENTION).z, dtype=float).ravel()
        seen = z[~np.isnan(z)]
        assert len(seen) > 0 and seen.max() == pytest.approx(1.0)
        owners = grid_owners(x)
        assert set(np.flatnonzero(~np.isnan(z[:len(owners)]))) <= set(np.flatnonzero(owners != EMPTY_BAND))
        x.layer_menu.value = x.layer_menu.options[1]
        assert x.grid.attention_layer == int(x.layer_menu.options[1])
        x.attention_box.value = False
        assert x.grid.trace(0, ATTENTION).z is None
    finally:
        x.close()


def test_a_recording_opens_in_the_explorer_with_its_timeline(tmp_path):
    x = Explorer(demo(), columns=32, history=False)
    path = tmp_path / "run.kvtrace"
    x.controls.record_path.value = str(path)
    x.controls.record.value = True
    x.session.step(5).result()
    x.controls.record.value = False
    assert "recording written" in x.controls.message.value
    x.close()
    replay = Explorer(str(path), columns=32)
    try:
        assert replay.controls is None and replay.settings is None and not replay.timeline.live
        assert replay.timeline.slider.max == len(replay.timeline.replay)
        replay.timeline.seek(len(replay.timeline.replay) - 1)
        used_at_end = int((grid_owners(replay) != EMPTY_BAND).sum())
        assert used_at_end > 0
        replay.timeline.seek(-1)
        assert replay.grid._lanes == (), "before the first event there is no cache"
        replay.timeline.kind.value = "cells"
        used = []
        while replay.timeline.jump(1) is not None and len(used) < 40:  # the snapshots of empty caches, then cells
            used.append(int((grid_owners(replay) != EMPTY_BAND).sum()))
            if used[-1]:
                break
        assert 0 < used[-1] < used_at_end and "CellsAllocated" in replay.timeline.label.value
    finally:
        replay.close()


def shown_strings(page: str) -> list[str]:
    """Every double-quoted JSON string of a page, decoded as the browser's JavaScript decodes it."""
    import json
    import re

    found = []
    for literal in re.findall(r'"(?:[^"\\\n]|\\.)*"', page):
        try:
            found.append(json.loads(literal))
        except ValueError:  # an HTML attribute, not JSON
            continue
    return found


def test_shown_strings_decode_both_encoders_alike():
    import json

    title = {"text": "base · full"}
    for page in (json.dumps(title), json.dumps(title, ensure_ascii=False)):
        assert "base · full" in shown_strings(page)


def test_a_view_exports_to_standalone_html(explorer, tmp_path):
    x = explorer
    x.session.step(3).result()
    page = x.export_html(tmp_path / "view.html").read_text()
    # the titles as the browser reads them: plotly writes "·" as is or as \u00b7, by which JSON encoder
    # it finds (orjson or the standard library's)
    texts = " ".join(shown_strings(page))
    assert page.count("plotly") > 10 and "base · full" in texts and "swa · window 16" in texts
    assert page.count("Plotly.newPlot") == 3
    single = x.grid.export_html(tmp_path / "grid.html").read_text()
    assert single.count("Plotly.newPlot") == 1


def test_a_remote_session_is_followed_and_driven_from_the_explorer():
    import time

    from engine.runners.serve import SessionServer
    from engine.watch.remote import RemoteSession
    from tests.test_remote import free_port_pair

    port = free_port_pair("127.0.0.1", set())
    with Session("demo", settings=DEMO_SETTINGS, workload=WORKLOAD) as session, \
            SessionServer("127.0.0.1", port) as server:
        server.start(session)
        remote = RemoteSession(server.command_address, token=server.token, timeout=5)
        x = Explorer(remote, columns=32)
        try:
            assert x.timeline is None and x._ticker is not None, "a remote session is followed by the browser's ticks"
            x.controls.n_steps.value = 4
            x.controls.step.click()
            cells = None
            for _ in range(100):  # the ticks: redraws on the kernel's own thread
                x._ticker.value += 1
                if "step 4" in x.status.value:
                    cells = session.engine_cells().result()
                    x._ticker.value += 1
                    break
                time.sleep(0.05)
            assert cells is not None, x.status.value
            engine = cells["base"]["cells"][0]
            assert ((grid_owners(x) != EMPTY_BAND) == np.array([pos >= 0 for pos, _, _ in engine])).all()
            assert "4 steps done" in x.controls.message.value
            x.settings.fields["n_ctx"].value = "512"
            assert x.settings.estimate(), x.settings.estimate_text.value
        finally:
            x.close()


def test_the_pieces_open_a_recording_in_one_line(tmp_path):
    from engine.watch.recording import Recorder
    from explorer import CellGrid, EventLog, MemoryBars, SwaWindow, Timeline

    path = tmp_path / "run.kvtrace"
    with demo() as session, Recorder(path) as recorder:
        recorder.attach(session.bus)
        session.step(6).result()
        recorder.pump()
        final = session.engine_cells().result()["swa"]["cells"][0]
    grid = CellGrid.of(str(path), columns=32)
    assert ((np.array(grid.trace(1, CELLS).z, dtype=float).ravel()[:256] != EMPTY_BAND)
            == np.array([pos >= 0 for pos, _, _ in final])).all()
    assert SwaWindow.of(str(path), seq=1).seen is not None
    assert "CPU" in MemoryBars.of(str(path)).figure.data[0].y
    assert "DecodeFinished" in EventLog.of(str(path)).text.value
    timeline = Timeline.open(path)
    box = timeline.show(CellGrid, EventLog)
    assert len(box.children) == 3 and len(timeline.views) == 2
    timeline.seek(3)
    assert timeline.views[0].watcher is timeline.replay.watcher and "event 4 of" in timeline.label.value
    timeline.close()


def test_a_view_exports_to_png_for_slides(explorer, tmp_path):
    pytest.importorskip("kaleido", reason="PNG export needs kaleido (the jupyter extra)")
    from PIL import Image

    from tests.jupyter_browser import find_chromium

    if find_chromium() is None:
        pytest.skip("PNG export needs Chrome or Chromium; none on the PATH")
    x = explorer
    x.session.step(3).result()
    path = x.export_png(tmp_path / "view.png", width=800, scale=1.0)
    with Image.open(path) as image:
        heights = [f.layout.height for f in x.figures()]
        assert image.format == "PNG" and image.width == 800 and image.height == sum(heights)
        colours = {c for _, c in image.convert("RGB").getcolors(1 << 20)}
    from engine.watch import style

    def rgb(colour: str) -> tuple[int, int, int]:
        return tuple(int(colour[k:k + 2], 16) for k in (1, 3, 5))

    # the shared system prompt (seq 0, copied to every client) and seq 1's own cells, in their colours
    assert rgb(style.SHARED_COLOR_ON_LIGHT) in colours and rgb(style.seq_color(1, False)) in colours


def test_prompt_state_and_clear_from_the_controls(explorer, tmp_path):
    x = explorer
    x.session.step(4).result()
    x.controls.prompt.value = "Who built the ark?"
    x.controls.add_prompt.click()
    assert "prompt added" in x.controls.message.value
    before = grid_owners(x).copy()
    x.controls.state_path.value = str(tmp_path / "whole.bin")
    x.controls.save.click()
    assert "saved to" in x.controls.message.value and (tmp_path / "whole.bin").stat().st_size > 0
    x.controls.load.click()
    assert "the parallel workload owns its sequences" in x.controls.message.value, "told, not raised"
    x.controls.workload.value = "generate"
    assert "workload: generate" in x.controls.message.value
    x.controls.ops["clear"].click()
    assert "cache cleared" in x.controls.message.value and (grid_owners(x) == EMPTY_BAND).all()
    x.controls.load.click()
    assert "state loaded" in x.controls.message.value
    assert (grid_owners(x) == before).all(), "the grid shows the cells the state file held"
    x.controls.seq_only.value = True
    x.seq_menu.value = "none"
    x.controls.save.click()
    assert "select a sequence first" in x.controls.message.value
    x.controls.state_path.value = str(tmp_path / "missing" / "dir" / "x.bin")
    x.controls.seq_only.value = False
    x.controls.load.click()
    assert "load_state failed" in x.controls.message.value


def test_the_server_view_shows_each_turn_and_slot():
    from engine.runners.session import Session
    from engine.runners.workloads import WorkloadSpec
    from explorer import Explorer, ServerView

    spec = WorkloadSpec(kind="server", n_clients=2, sampler={"temperature": 0.0})
    with Session("demo", settings=dict(n_ctx=2048, n_seq_max=2, n_batch=64, n_ubatch=64), workload=spec,
                 threaded=False) as session:
        view = ServerView.of(session, widget=False)
        assert not view.server.active and not view.figure.data[0].x
        session.step(400).result()
        view.update()
        totals = view.server.totals()
        reused, lost, new = (list(trace.y) for trace in view.figure.data)
        assert len(reused) == totals["tasks"] == 8
        assert sum(reused) == totals["reused"] and sum(reused) + sum(lost) + sum(new) == totals["prompt"]
        texts = [a.text for a in view.figure.layout.annotations]
        assert any(t.startswith("forced") for t in texts) and any(t.startswith("restored") for t in texts)
        assert any("!" in t for t in texts)  # the QUIRK of a needless checkpoint search
        assert "slot 0" in view._slots_text(view.server) and "MiB host memory" in view._slots_text(view.server)
        explorer = Explorer(session, start=False, history=False)
        try:
            assert explorer.server.widget.layout.display is None  # shown: the session runs a server
            assert explorer.server.figure in explorer.figures()
        finally:
            explorer.close()


def test_a_large_grid_redraws_less_often_by_default():
    """The demo's 512 cells redraw every 0.2 s; a 16k-cell cache every 0.4 s (at 0.2 s such a grid
    saturated the browser: cells run meanwhile waited seconds for their output); a cadence given is kept."""
    from explorer.explorer import LARGE_GRID_CELLS, default_every_s

    assert default_every_s(LARGE_GRID_CELLS) == 0.2 and default_every_s(LARGE_GRID_CELLS + 1) == 0.4
    small = Explorer(demo(), columns=32, history=False)
    big = Explorer(demo(n_ctx=16384), columns=128, history=False)
    given = Explorer(demo(n_ctx=16384), columns=128, history=False, every_s=0.25)
    try:
        assert small.every_s == 0.2 and big.every_s == 0.4 and given.every_s == 0.25
        assert big.grid._lanes[0][2] == 16384  # the cells counted are the ones the grid draws
    finally:
        for x in (small, big, given):
            x.close()


def test_the_engine_log_panel_shows_the_sessions_lines_by_level(explorer, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="kvscope")  # pytest listens here: the session keeps what is made
    say = logging.getLogger("kvscope.generate")
    x = explorer
    assert x.session_log.level.value == "info" and "no line at info or above yet" in x.session_log.text.value
    x.session.call(lambda: (say.info("llama_context: n_ctx = 256"), say.debug("a debug line"),
                            say.warning("context full, swapping: n_past = 111, n_left = 110")))
    logging.getLogger("kvscope.generate").warning("a line of no session")  # this thread, outside a command
    x.session.step(1).result()  # a step redraws the explorer
    shown = x.session_log.text.value
    assert "llama_context: n_ctx = 256" in shown and "context full, swapping: n_past = 111" in shown
    assert "a debug line" not in shown and "a line of no session" not in shown
    assert "color:#B8860B'>context full" in shown  # a warning reads as one
    x.session_log.level.value = "warning"
    assert "context full" in x.session_log.text.value and "n_ctx = 256" not in x.session_log.text.value
    assert "1 line at warning and above" in x.session_log.summary.value
    x.session_log.level.value = "debug"  # kept from now on
    assert x.session.log.level == "debug"
    x.session.call(lambda: say.debug("after swap: n_past = 56"))
    x.session.step(1).result()
    assert "after swap: n_past = 56" in x.session_log.text.value
    assert "a debug line" not in x.session_log.text.value  # made before debug was chosen: not kept


def test_the_explorer_keeps_the_engine_log_out_of_the_notebook_cells():
    """In a kernel nobody configures logging: a line the worker logs while the explorer's session generates
    went, through Python's last resort, to stderr, which Jupyter shows under whichever cell runs next."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import time
        from engine.runners.session import Session
        from engine.runners.workloads import WorkloadSpec
        from explorer import Explorer

        session = Session("demo", settings=dict(n_ctx=32, pad=32, n_seq_max=1), threads=1,
                          workload=WorkloadSpec("generate", n_predict=40, context_shift=True))
        x = Explorer(session, history=False)
        session.add_prompt("And God said").result()
        session.step(40).result()
        deadline = time.monotonic() + 30
        while "context full" not in x.session_log.text.value and time.monotonic() < deadline:
            time.sleep(0.1)  # the worker's redraw after the last step
        print(x.session_log.text.value)
        x.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "context full, swapping: n_past = 31" in done.stdout


def test_the_pacer_skips_ticks_that_queued_behind_a_slow_redraw():
    from explorer.pacing import RedrawPacer

    pacer = RedrawPacer(every_s=0.2)
    assert pacer.due(now=0.0)
    pacer.drawn(0.0, 0.5)  # 0.5 s: the ticks of 0.2 and 0.4 s waited in the kernel meanwhile
    assert not pacer.due(now=0.5) and not pacer.due(now=0.51)
    assert pacer.due(now=1.0) and pacer.skipped == 2
    for started in (1.0, 2.0):
        pacer.drawn(started, started + 0.5)
    assert pacer.slowed() == 0.5  # a redraw takes longer than the cadence allows
    fast = RedrawPacer(every_s=0.2)
    for started in (0.0, 0.2, 0.4):
        fast.drawn(started, started + 0.05)
    assert fast.slowed() is None and fast.due(now=0.6)  # the next tick, 0.2 s on


def test_views_slower_than_the_cadence_redraw_less_often_and_say_so():
    """Backpressure: a slow grid makes the worker's redraws of a running session come less often (each draws
    the state the steps meanwhile left), and the status line says that the views are behind."""
    import time

    session = Session("demo", settings=DEMO_SETTINGS, workload=WORKLOAD, steps_per_second=20)
    x = Explorer(session, columns=32, history=False, every_s=0.05)
    try:
        draw_grid = x.grid.update

        def slow_grid_update():
            time.sleep(0.25)
            return draw_grid()

        x.grid.update = slow_grid_update
        redraws_before = len(x.update_seconds)
        session.start().result()
        time.sleep(3.0)
        session.pause().result()
        time.sleep(0.8)  # the last redraw, after the pause
        redraws = len(x.update_seconds) - redraws_before
        # 0.25 s of drawing, then 0.25 s of steps at 20 per second: about 5 (fewer on a busy machine), not 1
        assert session.status().step / redraws >= 2.5, (session.status().step, redraws)
        assert "views behind: a redraw takes" in x.status.value and "redrawing at most every" in x.status.value
        engine = x.session.engine_cells().result()["base"]["cells"][0]
        assert ((grid_owners(x) != EMPTY_BAND) == np.array([pos >= 0 for pos, _, _ in engine])).all()

        x.update()
        x._tick()  # a follow tick (a remote session's) that queued behind that redraw is skipped and counted
        assert x.pacer.skipped == 1
        time.sleep(0.6)
        x._tick()
        assert x.pacer.skipped == 1 and "1 tick skipped" in x.status.value
    finally:
        x.close()


def test_the_mask_panel_draws_the_last_ubatch_only_while_open(explorer):
    """The terminal explorer's `m`, folded in the notebook: opened, it draws the last ubatch's mask in the cache
    chosen, as engine.watch.attention_mask computes it; closed, it costs no redraw."""
    from engine.watch.attention_mask import last_ubatch_mask

    x = explorer
    x.controls.n_steps.value = 3
    x.controls.step.click()
    assert x.mask_panel.selected_index is None and x.mask.mask is None  # folded: not drawn after the steps
    x.mask_panel.selected_index = 0
    expected = last_ubatch_mask(x.mask.watcher, "base")
    assert expected is not None and x.mask.mask is not None
    assert (x.mask.mask.allowed == expected.allowed).all() and x.mask.mask.cache == "base"
    assert list(x.mask_cache.options) == ["base", "swa"]
    x.mask_cache.value = "swa"
    assert x.mask.mask.cache == "swa" and x.mask.mask.n_swa == 16
    x.controls.step.click()
    assert x.mask.mask.ubatch >= 0 and (x.mask.mask.allowed == last_ubatch_mask(x.mask.watcher, "swa").allowed).all()
