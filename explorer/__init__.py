"""kvscope's notebook explorer: plotly and ipywidgets views of a session's KV cache, drawn from the
watch layer.

Like the terminal explorer (tui/), it imports only the session, `engine.watch` and `engine.events`;
colours, glyph meanings, the event log's lines and filters, the status line and the settings fields
come from engine/watch, so both explorers read alike.

    from explorer import Explorer
    Explorer()                       # everything, on the demo session, live

    grid = CellGrid.of(session)      # or one piece: a heatmap per cache stream
    bars = MemoryBars.of(session)    # weights / K/V / compute per device, and the layer map
    SwaWindow.of(session, seq=1)     # what seq 1's next token sees, position by position
    MaskView.of(session, cache="base")  # the last ubatch's attention mask: its tokens x the cells
    EventLog.of(session)             # the latest events, filtered
    ServerView.of(session)           # a server workload's turns (reused / recomputed / new) and slots
    SessionLogPanel(session)         # the engine's log lines of a session run here, by level
    grid.follow(session)             # redrawn live by the session's worker after each change
    Timeline.open("run.kvtrace")     # a slider over a recording; attach(grid, ...) the views it moves
    Compare.of_settings(a=dict(type_k="f16"), b=dict(type_k="q4_0"), prompt="And God said")  # A/B

    Explorer.attach(vllm=["tcp://10.0.0.5:5557"])   # a vLLM / SGLang deployment's prefix caches, from KV events
    BlockViews.of(subscriber)        # its lanes of blocks, prefix tree, router view and evictions alone
"""
from explorer.blocks import BlockViews
from explorer.compare import Compare
from explorer.event_log import EventLog
from explorer.explorer import Explorer
from explorer.grid import CellGrid
from explorer.mask import MaskView
from explorer.memory import MemoryBars
from explorer.server import ServerView
from explorer.session_log import SessionLogPanel
from explorer.timeline import Timeline
from explorer.window import SwaWindow

__all__ = ["BlockViews", "CellGrid", "Compare", "EventLog", "Explorer", "MaskView", "MemoryBars", "ServerView",
           "SessionLogPanel", "SwaWindow", "Timeline"]
