"""What every notebook view shares: it draws from a Watcher, is made from anything a Watcher can watch,
and can be redrawn live by a session's worker."""
from __future__ import annotations

from typing import Callable

from engine.watch.watcher import Watcher


class WatcherView:
    """A view drawn from `self.watcher`; subclasses implement update()."""

    watcher: Watcher

    def update(self) -> object:
        raise NotImplementedError

    @classmethod
    def of(cls, source, **options):
        """The view of a Session or a RemoteSession (anything a Watcher can watch)."""
        return cls(Watcher.of(source), **options)

    def follow(self, session, every_s: float = 0.2) -> Callable[[], None]:
        """Redraw live: the session's worker calls update() after its steps and commands (at most every
        `every_s` seconds, and after the last change). Call only this from then on, not update() by hand
        as well; returns a function that stops it."""
        return session.on_change(self.update, every_s)
