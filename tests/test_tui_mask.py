"""The terminal explorer's attention mask (key m, tui/mask.py), driven with Textual's pilot: the glyphs are the
watch layer's mask of the last ubatch (the kernel's own, tests/test_attention_mask.py), the key is in the key bar,
the help and the command palette, and [ ] shows the other cache."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch import style
from engine.watch.attention_mask import MaskCell, last_ubatch_mask
from engine.watch.sources import session_source
from tui.app import KvscopeApp
from tui.mask import (
    GLYPH_MASKED,
    GLYPH_OUTSIDE,
    GLYPH_OWN,
    MaskScreen,
    mask_title,
    row_label,
)
from tui.screens import HelpScreen, help_text

pytestmark = pytest.mark.anyio
SETTINGS = dict(n_ctx=128, pad=32, n_seq_max=4, kv_unified=True, swa_full=False, swa_window=8)
GLYPHS = {MaskCell.EMPTY: style.GLYPH_EMPTY, MaskCell.OTHER: GLYPH_MASKED, MaskCell.LATER: GLYPH_MASKED,
          MaskCell.WINDOW: GLYPH_OUTSIDE, MaskCell.ATTENDED: style.GLYPH_ONE, MaskCell.OWN: GLYPH_OWN}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def session():
    s = Session("demo", settings=SETTINGS, threaded=False,
                workload=WorkloadSpec("generate", n_predict=40, sampler=SamplerParams(temperature=0.0, seed=1)))
    yield s
    s.close()


def rendered(renderable) -> str:
    console = Console(width=100, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return " ".join(console.export_text().split())  # the words, however the rows wrap and align


def shown(app, selector: str) -> str:
    """The text a panel of the mask dialog shows."""
    return app.screen.query_one(selector)._shown.plain


def assert_rows_are_the_mask(text: str, mask) -> None:
    lines = text.split("\n")
    for k in range(mask.n_tokens):
        label = row_label(mask, k)
        (line,) = [ln for ln in lines if ln.startswith(label + " ")]
        glyphs = line[len(line) - mask.n_used:]
        assert glyphs == "".join(GLYPHS[MaskCell(int(c))] for c in mask.codes[k, :mask.n_used]), label


async def test_m_shows_the_last_ubatchs_mask_and_brackets_the_other_cache(session):
    app = KvscopeApp(session_source(session))
    session.add_prompt("And God said unto Moses").result()
    session.add_prompt("In the beginning God created").result()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "m mask" in app.query_one("#keys").render().plain
        await pilot.press("m")
        assert isinstance(app.screen, MaskScreen)
        assert "no ubatch placed in cache base" in shown(app, "#mask-title")
        for _ in range(6):  # the prompts, then decode steps past the window of 8
            session.step(1).result()
        app.refresh_view()
        app.screen.redraw()
        await pilot.pause()
        screen = app.screen
        mask = last_ubatch_mask(app.watcher, "base")
        assert screen.cache == "base" and screen.mask.allowed.tolist() == mask.allowed.tolist()
        assert mask.title() in shown(app, "#mask-title")
        assert mask.describe_row(mask.n_tokens - 1) in shown(app, "#mask-words")
        assert_rows_are_the_mask(shown(app, "#mask"), mask)
        await pilot.press("right_square_bracket")
        swa = screen.mask
        assert screen.cache == "swa" and swa.n_swa == 8 and (swa.codes == MaskCell.WINDOW).any()
        assert_rows_are_the_mask(shown(app, "#mask"), swa)
        assert GLYPH_OUTSIDE in shown(app, "#mask") and "sliding window of 8" in shown(app, "#mask-title")
        await pilot.press("m")
        assert not isinstance(app.screen, MaskScreen)


async def test_the_mask_is_in_the_help_and_the_palette(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "m the last ubatch's attention mask" in rendered(help_text(True, replay=False))
        assert "m the attention mask of the last ubatch" in rendered(help_text(True, replay=True))
        await pilot.press("escape")
        await pilot.press("ctrl+p")
        await pilot.press(*"attention mask")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, MaskScreen)


def test_the_text_says_there_is_no_ubatch_yet():
    assert "no ubatch placed in cache kv" in mask_title(None, cache="kv").plain
