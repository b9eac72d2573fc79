"""kvscope's notebook explorer: plotly views of a session's KV cache, drawn from the watch layer.

Like the terminal explorer (tui/), it imports only the session, `engine.watch` and `engine.events`;
colours, glyph meanings and folding come from engine/watch/style.py, so both explorers read alike.

    from explorer import CellGrid
    grid = CellGrid.of(session)      # a FigureWidget: one heatmap per cache stream
    bars = MemoryBars.of(session)    # weights / K/V / compute per device, and the layer map
    session.step(8).result(); grid.update(); bars.update()
    grid.follow(session)             # or: redrawn live by the session's worker after each change
"""
from explorer.grid import CellGrid
from explorer.memory import MemoryBars

__all__ = ["CellGrid", "MemoryBars"]
