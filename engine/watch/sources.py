"""Where the explorer's events come from, behind one face: a session run here, a remote session, or a
recording replayed. Each gives a Watcher and says which controls it has."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.watch.watcher import Watcher


@dataclass
class Source:
    """A session-like object (Session or RemoteSession) and its watcher, or a replay. `live` is False for
    a replay, whose controls are the replay's (step back and forth, seek)."""

    kind: str  # "session", "remote", "replay", "attached" (a llama.cpp log) or "kv-events" (vLLM/SGLang publishers)
    own_watcher: Watcher | None = None
    session: Any = None  # Session or RemoteSession: start, pause, step, add_prompt, seq_rm, ...
    replay: Any = None  # engine.watch.replay.Replay of a recording
    label: str = ""
    attached: Any = None  # engine.runners.attach.AttachedLog: a real llama.cpp's log, read as it comes; or
    # engine.watch.kv_events.subscriber.KvEventSubscriber: vLLM/SGLang workers' KV events

    @property
    def live(self) -> bool:
        """Whether the source takes commands (step, prompt, seq ops): a session does; a replay and an
        attached llama.cpp process do not (what cannot be sent to a real process is not offered)."""
        return self.session is not None

    @property
    def shows_blocks(self) -> bool:
        """Whether its views are the block views (vLLM / SGLang workers' prefix caches) rather than cell grids:
        a live KV event stream, or a recording of one (workers heard from, no cache of cells created)."""
        if self.kind == "kv-events":
            return True
        if self.replay is not None:
            kinds = self.replay.reader.kinds()  # read once and kept: the replay's jumps use it too
            return "KvWorkerSeen" in kinds and "ContextCreated" not in kinds
        return False

    @property
    def watcher(self) -> Watcher:
        """The watcher to draw from (a replay may rebuild its own when it seeks backward)."""
        return self.replay.watcher if self.replay is not None else self.own_watcher

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.replay is not None:
            self.replay.close()
        if self.attached is not None:
            self.attached.close()


def session_source(session, label: str = "") -> Source:
    return Source("session", Watcher.of(session), session=session, label=label)


def remote_source(remote, label: str = "") -> Source:
    return Source("remote", Watcher.of(remote), session=remote, label=label)


def attached_source(attached, label: str = "") -> Source:
    """A llama.cpp process's log (or a saved log) as the explorer's source: watched, never driven."""
    return Source("attached", Watcher.of(attached), attached=attached, label=label or attached.label)


def kv_events_source(subscriber, label: str = "") -> Source:
    """vLLM or SGLang workers' prefix caches, from their KV event publishers: watched, never driven."""
    return Source("kv-events", Watcher.of(subscriber), attached=subscriber, label=label or subscriber.label)


def replay_source(path) -> Source:
    from engine.watch.recording import RecordingReader
    from engine.watch.replay import Replay

    return Source("replay", replay=Replay(RecordingReader(path)), label=str(path))
