"""Backpressure for the explorer's redraws: when the views take longer to draw than the cadence asks, the
redraws come less often instead of queueing up, and the page says so.

A session run here redraws on its worker, which spaces a slow redraw by its own time (Session.on_change).
A remote session is redrawn on the kernel's thread at each tick of a Play widget in the browser; ticks that
queued in the kernel while a slow redraw ran would each redraw in turn, the explorer falling ever further
behind the browser's clock (and the cells run meanwhile waiting behind them). RedrawPacer skips them: a
redraw waits as long as the last one took, and then draws the latest state, so drawing takes at most half
the thread. Either way `slowed()` tells the status line when the views are what limits the redraws.
What a redraw draws is always the watcher's state as it stands (a watcher that lost events resyncs first),
so a skipped redraw loses nothing but a picture in between.
"""
from __future__ import annotations

import collections
import statistics
import time

MEASURED_REDRAWS = 8  # the latest redraws whose times say whether the views keep up


class RedrawPacer:
    """When the next redraw may run (see the module docstring), and how the latest ones went."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.skipped = 0  # ticks that came while the views were still catching up, not drawn
        self._next_at = 0.0
        self._seconds: collections.deque[float] = collections.deque(maxlen=MEASURED_REDRAWS)

    def due(self, now: float | None = None) -> bool:
        """Whether a tick arriving now should redraw; one that should not is counted as skipped."""
        if (time.monotonic() if now is None else now) >= self._next_at:
            return True
        self.skipped += 1
        return False

    def drawn(self, started: float, ended: float) -> None:
        """A redraw ran from `started` to `ended` (time.monotonic())."""
        self._seconds.append(ended - started)
        self._next_at = ended + (ended - started)

    def slowed(self) -> float | None:
        """The seconds a redraw takes, when that is more than the cadence allows (every_s), so that the
        views redraw every twice that at most; None while they keep up."""
        if len(self._seconds) < 3:
            return None
        takes = statistics.median(self._seconds)
        return takes if takes > self.every_s else None
