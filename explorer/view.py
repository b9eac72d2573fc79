"""What every notebook view shares: it draws from a Watcher, is made from anything a Watcher can watch,
shows itself in a notebook, can be redrawn live by a session's worker, and exports to HTML and PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.watch.watcher import Watcher


# The text of a log view: lines of its own height, since the page's (a JupyterLab widget's 28 px) pushed the
# latest lines out of the box sized for them, below its scroll.
LOG_TEXT_STYLE = "font-family: monospace; font-size: 12px; line-height: 1.4; white-space: pre"


class Shown:
    """Anything the notebook explorer shows: it displays `widget` and exports the plotly figures it draws
    (figures()) to one standalone HTML page or one PNG."""

    widget: object  # what a notebook displays: a plotly FigureWidget or an ipywidgets box
    export_title = "kvscope"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def figures(self) -> list:
        """The plotly figures it draws (exported to HTML and PNG)."""
        figure = getattr(self, "figure", None)
        return [figure] if figure is not None else []

    def export_html(self, path: str | Path) -> Path:
        """Its figures as one standalone HTML file (plotly's JavaScript inlined once: it opens offline)."""
        from explorer.export import figures_html

        path = Path(path)
        path.write_text(figures_html(self.figures(), title=self.export_title), encoding="utf-8")
        return path

    def export_png(self, path: str | Path, *, width: int = 1200, scale: float = 2.0) -> Path:
        """Its figures as one PNG for slides (kaleido, through the machine's Chrome or Chromium)."""
        from explorer.export import figures_png

        return figures_png(self.figures(), Path(path), width=width, scale=scale)


class WatcherView(Shown):
    """A view drawn from `self.watcher` into `self.widget`; subclasses implement update()."""

    watcher: Watcher
    # How a redraw a control asks for is run: directly, or on the session's worker (Session.call) once the
    # view follows a session, so that it never overlaps the worker's own redraws.
    runner: Callable[[Callable[[], object]], object] | None = None

    def update(self) -> object:
        raise NotImplementedError

    @property
    def export_title(self) -> str:
        return type(self).__name__

    @classmethod
    def of(cls, source, **options):
        """The view of a Session or a RemoteSession (anything a Watcher can watch), or of a recording's
        path, shown at its last event (Timeline.open(path).show(...) scrubs it)."""
        if isinstance(source, (str, Path)):
            from engine.watch.replay import Replay

            replay = Replay.open(source)
            replay.seek(len(replay) - 1)
            return cls(replay.watcher, **options)
        return cls(Watcher.of(source), **options)

    def follow(self, session, every_s: float = 0.2) -> Callable[[], None]:
        """Redraw live: the session's worker calls update() after its steps and commands (at most every
        `every_s` seconds, and after the last change). Call only this from then on, not update() by hand
        as well; returns a function that stops it."""
        self.runner = session.call
        return session.on_change(self.update, every_s)

    def redraw(self) -> None:
        """update(), where updates of this view run (see `runner`): for the view's own controls."""
        if self.runner is None:
            self.update()
        else:
            self.runner(self.update)

    def show(self, watcher: Watcher) -> object:
        """Draw from another watcher from now on (a timeline's replay, or the live one again)."""
        self.watcher = watcher
        self.forget()
        return self.update()

    def forget(self) -> None:
        """Drop what the view keeps between updates (the watcher it came from was replaced or rebuilt)."""


def observe_value(menu, on_change: Callable[[object], None]) -> None:
    """Call on_change(new value) when a person changes the control (not when replace_options does)."""
    def changed(change) -> None:
        if not getattr(menu, "_options_replaced", False):
            on_change(change["new"])
    menu.observe(changed, names="value")


def replace_options(menu, options: list) -> None:
    """New options for a Dropdown that keep its value in them (ipywidgets resets the value to the first
    option when the options change; observe_value's callbacks do not see that)."""
    choose(menu, menu.value, options)


def choose(menu, value, options: list | None = None) -> None:
    """Set a Dropdown's value (and options; the value is added to them when missing) without its
    observe_value callbacks seeing it: the code, not a person, chose it."""
    options = list(menu.options) if options is None else options
    if value not in options:
        options = [*options, value]
    if list(menu.options) == options and menu.value == value:
        return
    menu._options_replaced = True
    try:
        if list(menu.options) != options:
            menu.options = options
        menu.value = value
    finally:
        menu._options_replaced = False


def row(children: list) -> object:
    """Controls side by side, wrapping onto the next line where the page is narrow (a row never widens
    the explorer past the notebook)."""
    import ipywidgets as widgets

    return widgets.HBox(children, layout=widgets.Layout(flex_flow="row wrap", align_items="center"))
