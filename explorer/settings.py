"""The settings panel: the context settings as fields (engine/watch/settings_form.py, as the terminal
explorer's settings screen), the memory the new context would take per device shown before anything
changes, and Apply, which rebuilds the context with them (the cache starts empty)."""
from __future__ import annotations

import html

import ipywidgets as widgets

from engine.watch.settings_form import SETTINGS, estimate_lines, parse_settings, shown


class SettingsPanel:
    """Fields for `session`'s settings; estimate() shows what they would take, apply() rebuilds."""

    def __init__(self, session, tell=None) -> None:
        """tell(text, ok): where the result of Apply is reported (the explorer's message line)."""
        self.session, self.tell = session, tell or (lambda text, ok=True: None)
        current = session.status().settings if session is not None else {}
        self.fields = {name: widgets.Text(value=shown(current.get(name)), description=name, tooltip=what,
                                          placeholder=what, layout=widgets.Layout(width="300px"),
                                          style={"description_width": "95px"})
                       for name, _, what in SETTINGS}
        self.estimate_button = widgets.Button(description="Estimate", tooltip="memory per device, nothing changes")
        self.apply_button = widgets.Button(description="Apply", button_style="primary",
                                           tooltip="rebuild the context with these settings (the cache starts empty)")
        self.estimate_text = widgets.HTML()
        self.estimate_button.on_click(lambda _: self.estimate())
        self.apply_button.on_click(lambda _: self.apply())
        names = list(self.fields)
        half = (len(names) + 1) // 2
        self.widget = widgets.VBox([
            widgets.HBox([widgets.VBox([self.fields[n] for n in names[:half]]),
                          widgets.VBox([self.fields[n] for n in names[half:]])]),
            widgets.HBox([self.estimate_button, self.apply_button]), self.estimate_text])

    def parsed(self) -> dict:
        """The fields as settings; ValueError naming the field that does not parse."""
        return parse_settings({name: field.value for name, field in self.fields.items()})

    def estimate(self) -> bool:
        """Show what each device would hold; False (and why) when the settings are bad or do not fit."""
        try:
            fits, lines = estimate_lines(self.session.estimate(**self.parsed()))
        except Exception as e:  # noqa: BLE001 - a bad value is told here, never raised into the notebook
            self.estimate_text.value = f"<span style='color:#C00000'>cannot use these settings: {html.escape(str(e))}</span>"
            return False
        colour = "" if fits else "color:#C00000"
        self.estimate_text.value = f"<pre style='margin:0;{colour}'>{html.escape(chr(10).join(lines))}</pre>"
        return fits

    def apply(self):
        """Rebuild the context with the fields' settings, when they parse and fit; the session's Future."""
        if not self.estimate():
            self.tell("settings not applied: see the estimate", False)
            return None
        settings = self.parsed()
        future = self.session.rebuild(**settings)
        future.add_done_callback(lambda f: self.tell(
            "context rebuilt" if f.exception() is None else f"rebuild failed: {f.exception()}", f.exception() is None))
        return future
