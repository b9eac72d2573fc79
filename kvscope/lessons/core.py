"""The sentence under an output, the still picture of a key moment, and the check of an exercise.

In a notebook they display Markdown and HTML; anywhere else (a script, a test) they print plain text, so a
lesson's module can be run and tested without Jupyter. `tools/render_lessons.py` runs every notebook with
KVSCOPE_LESSON_PICTURES=1: picture() then also shows a PNG of the view (kaleido, through the machine's
Chrome or Chromium), which the rendered copy under docs/lessons/ keeps for readers on a code host, where
the live widgets do not draw.
"""
from __future__ import annotations

import html
import math
import os
import tempfile
from pathlib import Path

PICTURES_ENV = "KVSCOPE_LESSON_PICTURES"
PICTURE_WIDTH = 1000  # pixels: the width of a notebook's output area at 100%


def rendering() -> bool:
    """Whether the notebook runs for its rendered copy (stills of the views wanted)."""
    return os.environ.get(PICTURES_ENV, "") not in ("", "0")


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _show_markdown(text: str, plain: str) -> None:
    if _in_notebook():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(plain)


def say(text: str) -> None:
    """The sentence under an output: what the reader just saw, in words (Markdown)."""
    if not text.strip():
        raise ValueError("say() needs a sentence: an output without words is what it is for")
    _show_markdown(f"→ {text}", f"-> {text}")


def _figures(view) -> list:
    figures = view.figures() if hasattr(view, "figures") else [view]
    if not figures:
        raise ValueError(f"{type(view).__name__} draws no figure to picture")
    return figures


STILL_ATTEMPTS = 3  # kaleido's browser now and then fails a first export ("kaleido_scopes is not defined")


def _still(figures: list) -> bytes:
    """The figures as PNG bytes, retried: a render must not lose a still to the browser's hiccup."""
    from explorer.export import figures_png

    def export() -> bytes:
        with tempfile.TemporaryDirectory() as folder:
            return figures_png(figures, Path(folder) / "still.png", width=PICTURE_WIDTH, scale=1.0).read_bytes()

    for _ in range(STILL_ATTEMPTS - 1):
        try:
            return export()
        except RuntimeError:
            pass
    return export()


def picture(view, caption: str) -> None:
    """A key moment: the caption under the live view (say), and, when rendering, a still of the view too.

    view: a notebook explorer view (anything with figures()) or a plotly figure."""
    figures = _figures(view)
    if rendering():
        from IPython.display import Image, display

        display(Image(data=_still(figures), width=PICTURE_WIDTH))
    say(caption)


def _same(answer, expected, tolerance: float | None) -> bool:
    if tolerance is not None:
        return math.isclose(float(answer), float(expected), rel_tol=0.0, abs_tol=tolerance)
    if isinstance(expected, (set, frozenset)):
        return set(answer) == set(expected)
    if isinstance(expected, (list, tuple)):
        return list(answer) == list(expected)
    return answer == expected


def check(answer, expected, *, why: str, tolerance: float | None = None) -> bool | None:
    """An exercise's answer against what the engine computed: True (right), False (wrong), or None when the
    reader left `...` in place, with the answer behind a click (predict first, then reveal).

    tolerance: for numbers, how far off still counts as right."""
    if answer is ...:
        if _in_notebook():
            from IPython.display import HTML, display

            display(HTML(f"<details><summary>Replace <code>...</code> with your prediction and run the cell again, "
                         f"or click to reveal the answer</summary><p><b>{html.escape(repr(expected))}</b>: "
                         f"{html.escape(why)}</p></details>"))
        else:
            print(f"(no answer given) the answer: {expected!r}: {why}")
        return None
    try:
        right = _same(answer, expected, tolerance)
    except (TypeError, ValueError):
        right = False
    if right:
        _show_markdown(f"✅ **Right**: {why}", f"Right: {why}")
    else:
        _show_markdown(f"❌ **Not quite**: you said `{answer!r}`, the engine says `{expected!r}`. {why}",
                       f"Not quite: you said {answer!r}, the engine says {expected!r}. {why}")
    return right
