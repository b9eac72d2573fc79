"""The notebook explorer's cell grid, without a browser: the figure's cells, markers and hover texts are
the engine's cells, drawn from the watch layer only."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")

from engine.runners.session import Session  # noqa: E402
from engine.runners.workloads import WorkloadSpec  # noqa: E402
from engine.sampling import SamplerParams  # noqa: E402
from explorer.grid import CELLS, CHANGED, EMPTY_BAND, HEAD, MASKED, SHARED_BAND, CellGrid  # noqa: E402

SETTINGS = dict(n_ctx=256, pad=64, n_seq_max=4, kv_unified=True, swa_full=True, swa_window=16)


@pytest.fixture
def session():
    s = Session("demo", settings=SETTINGS, threaded=False,
                workload=WorkloadSpec("generate", n_predict=30, sampler=SamplerParams(temperature=0.0, seed=1)))
    yield s
    s.close()


def expected_bands(cells) -> list[int]:
    return [EMPTY_BAND if not seqs else (min(seqs) % 12 if len(seqs) == 1 else SHARED_BAND) for _, seqs, _ in cells]


def assert_grid_is_the_engine(grid: CellGrid, session: Session) -> None:
    caches = {c.name: c for c in session.ctx.memory.caches()}
    for k, (cache_name, stream, size) in enumerate(grid._lanes):
        heatmap, head = grid.trace(k, CELLS), grid.trace(k, HEAD)
        cells = caches[cache_name].cells(stream)
        z = np.array(heatmap.z, dtype=float).ravel()[:size]
        assert z.astype(int).tolist() == expected_bands(cells)
        text = np.array(heatmap.text, dtype=object).ravel()[:size]
        for cell in (0, size // 2, size - 1):
            pos = cells[cell][0]
            assert text[cell].startswith(f"pos {pos} · seq ") if pos >= 0 else text[cell].startswith("empty")
        engine_head = caches[cache_name].head(stream)
        assert list(head.x) == [engine_head % grid.columns] and list(head.y) == [engine_head // grid.columns]


def test_the_grid_shows_the_engine_cells_after_steps_and_a_copy(session):
    grid = CellGrid.of(session, columns=32, widget=False)
    for prompt in ("And God said unto Moses", "In the beginning", "Blessed are they"):
        session.add_prompt(prompt).result()
    session.step(12).result()
    grid.update()
    assert [lane[0] for lane in grid._lanes] == ["base", "swa"]
    assert_grid_is_the_engine(grid, session)
    session.seq_cp(0, 3, -1, -1).result()
    frame = grid.update()
    assert_grid_is_the_engine(grid, session)
    base = frame.stream("base")
    shared = np.flatnonzero(base.n_seqs > 1)
    assert len(shared) and set(shared.tolist()) <= set(np.flatnonzero(base.changed).tolist())
    changed = grid.trace(0, CHANGED)
    assert sorted(zip(changed.y, changed.x)) == sorted((c // 32, c % 32) for c in np.flatnonzero(base.changed))
    hover = np.array(grid.trace(0, CELLS).text, dtype=object).ravel()[shared[0]]
    assert "seq 0, 3" in hover and "shared with seq 3" in hover  # the cell's latest history


def test_a_rebuild_lays_the_grid_out_anew(session):
    grid = CellGrid.of(session, columns=64, widget=False)
    session.add_prompt("And God said unto Moses").result()
    grid.update()
    assert {lane[2] for lane in grid._lanes} == {256}
    session.rebuild(**{**SETTINGS, "n_ctx": 512}).result()
    session.add_prompt("In the beginning").result()
    grid.update()
    assert {lane[2] for lane in grid._lanes} == {512}
    assert np.array(grid.trace(0, CELLS).z).shape == (8, 64)
    assert_grid_is_the_engine(grid, session)
    assert "512 cells" in grid.figure.layout.annotations[0].text


def test_a_grid_follows_a_running_session_from_its_worker():
    import time

    with Session("demo", settings=SETTINGS, workload=WorkloadSpec("generate", n_predict=20)) as threaded:
        grid = CellGrid.of(threaded, columns=64, widget=False)
        stop = grid.follow(threaded, every_s=0.1)
        threaded.add_prompt("And God said unto Moses").result()
        threaded.step(10).result()
        time.sleep(0.5)  # the last redraw comes by itself
        stop()
        engine = threaded.engine_cells().result()
        for k, (cache, stream, size) in enumerate(grid._lanes):
            z = np.array(grid.trace(k, CELLS).z, dtype=float).ravel()[:size]
            assert z.astype(int).tolist() == expected_bands(engine[cache]["cells"][stream])


def test_selecting_a_sequence_crosses_its_cells_outside_the_sliding_window():
    settings = {**SETTINGS, "swa_full": False, "swa_window": 8}
    with Session("demo", settings=settings, threaded=False,
                 workload=WorkloadSpec("generate", n_predict=30, sampler=SamplerParams(temperature=0.0, seed=1))) as s:
        s.add_prompt("And God said unto Moses, and the LORD spake").result()
        s.step(6).result()
        grid = CellGrid.of(s, columns=32, widget=False)
        assert not any(len(grid.trace(k, MASKED).x or ()) for k in range(len(grid._lanes)))
        grid.select(0)
        lanes = [lane[0] for lane in grid._lanes]
        swa = lanes.index("swa")
        masked = grid.trace(swa, MASKED)
        cells = s.engine_cells().result()["swa"]["cells"][0]
        held = sorted(c for c, (p, seqs, _) in enumerate(cells) if 0 in seqs)
        newest = max(cells[c][0] for c in held)
        outside = [c for c in held if newest + 1 - cells[c][0] >= 8]  # llama.cpp: masked when p1 - p0 >= n_swa
        assert outside and sorted(y * 32 + x for x, y in zip(masked.x, masked.y)) == outside
        assert "seq 0's next token sees" in grid.figure.layout.annotations[swa].text
        assert not grid.trace(lanes.index("base"), MASKED).x  # full attention: sees all
        grid.select(None)
        assert not grid.trace(swa, MASKED).x


def test_cells_a_quirk_touched_are_marked_until_the_next_update():
    from engine import events as ev
    from explorer.grid import QUIRK

    # with split streams the dry run's rollback restores heads in a way llama.cpp's code does (a QUIRK),
    # which lasts when a later ubatch of the decode finds no cell: small streams, small ubatches
    settings = dict(n_ctx=320, pad=64, n_seq_max=5, kv_unified=False, swa_window=16, n_ubatch=8)
    with Session("demo", settings=settings, threaded=False, workload=WorkloadSpec(
            "parallel", n_clients=4, n_sequences=40, n_predict=30, sampler=SamplerParams(temperature=0.0, seed=1))) \
            as session:
        sub = session.subscribe(kinds=(ev.CellsChanged,))
        grid = CellGrid.of(session, widget=False)
        marked = []
        for _ in range(5):
            session.step(1).result()
            quirks = [e for e in sub.drain() if isinstance(e, ev.CellsChanged) and e.quirk]
            grid.update()
            lanes = [lane[:2] for lane in grid._lanes]
            for event in quirks:
                for change in event.changes:
                    k = lanes.index((event.cache, change.stream))
                    quirk = grid.trace(k, QUIRK)
                    shown = {int(y) * grid.columns + int(x) for x, y in zip(quirk.x, quirk.y)}
                    assert set(change.cells.tolist()) <= shown
                marked.append(event)
        assert marked, "split streams roll back the dry run's slots within 5 steps"
        grid.update()  # nothing new: no mark left
        assert not any(len(grid.trace(k, QUIRK).x or ()) for k in range(len(grid._lanes)))


def test_an_update_with_nothing_new_sends_nothing(session):
    grid = CellGrid.of(session, widget=False)
    session.add_prompt("In the beginning").result()
    session.step(2).result()
    grid.update()  # draws the step's marks
    drawn = []
    draw = grid._draw_lane
    grid._draw_lane = lambda *a: drawn.append(a[0]) or draw(*a)
    grid.update()  # clears them
    assert drawn
    drawn.clear()
    grid.update()
    assert drawn == [], "nothing changed: the lanes are not drawn again"
    grid.select(0)
    assert drawn, "a new selection is drawn"
    drawn.clear()
    session.step(1).result()
    grid.update()
    assert drawn


def test_a_grid_of_one_cache_draws_only_its_lanes(session):
    """caches=("base",): with swa_full the pair holds the same cells, and a lesson shows them once."""
    grid = CellGrid.of(session, columns=32, widget=False, caches=("base",))
    session.add_prompt("And God said unto Moses").result()
    session.step(6).result()
    frame = grid.update()
    assert [lane[0] for lane in grid._lanes] == ["base"] and [sf.cache for sf in frame.streams] == ["base"]
    assert len(grid.figure.layout.annotations) == 1  # one lane title
    assert_grid_is_the_engine(grid, session)


def test_a_lane_that_does_not_fill_its_last_row_sends_strict_json(session):
    """A notebook sends a FigureWidget's data as strict JSON: a NaN in z (the padding after the last cell, or a
    cell without attention) made it refuse the redraw, so gaps are None."""
    import json

    grid = CellGrid.of(session, columns=48, widget=False, caches=("base",))  # 256 cells: the last row is partial
    session.add_prompt("And God said unto Moses").result()
    session.step(3).result()
    grid.update()
    z = np.array(grid.trace(0, CELLS).z, dtype=object).ravel()
    assert z[-1] is None and sum(v is None for v in z) == 6 * 48 - 256
    json.dumps(z.tolist(), allow_nan=False)
