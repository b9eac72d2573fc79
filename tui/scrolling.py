"""Keeping the cursor's row in view in a lane-drawing ScrollView (the cell grid and the block lanes alike)."""
from __future__ import annotations

from textual.scroll_view import ScrollView


def scroll_to_lane_row(view: ScrollView, first_line: int, row: int) -> None:
    """Scroll `view` just enough that row `row` of the lane whose title is line `first_line` shows, with the
    lane's title too when the row is the lane's first in view."""
    line = first_line + 1 + row
    top, height = int(view.scroll_offset.y), view.size.height
    if line - 1 < top:
        view.scroll_to(y=max(0, line - 1), animate=False)
    elif line >= top + height:
        view.scroll_to(y=line - height + 1, animate=False)
