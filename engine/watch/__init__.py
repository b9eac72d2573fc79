"""The watch layer: everything a view needs, rebuilt from the event stream alone.

Nothing below this package imports torch or the model code, so a notebook, a terminal UI or a replay
viewer that only watches loads quickly and can run on a machine without the engine's weights: the
cache and device mirrors, per-cell history, SWA visibility, recordings and their reader.
"""
from engine.watch.attention import AttentionWatch
from engine.watch.device_mirror import DeviceMirror
from engine.watch.frames import Frame, StreamFrame
from engine.watch.history import CellHistory
from engine.watch.mirror import CacheMirror
from engine.watch.recording import Recorder, RecordingError, RecordingReader
from engine.watch.replay import Replay
from engine.watch.visibility import (
           CellVisibility,
           LayerKind,
           SequenceVisibility,
           visibility,
)
from engine.watch.watcher import Watcher

__all__ = ["AttentionWatch", "CacheMirror", "CellHistory", "CellVisibility", "DeviceMirror", "Frame", "LayerKind",
           "Recorder", "RecordingError", "RecordingReader", "Replay", "SequenceVisibility", "StreamFrame", "Watcher",
           "visibility"]
