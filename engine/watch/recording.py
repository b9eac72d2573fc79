"""Recordings of an event stream (`.kvtrace` files): a Recorder writes one from a bus
(engine/watch/recorder.py), a RecordingReader replays it into the watch layer and seeks to any event
(engine/watch/recording_reader.py); the layout is engine/watch/recording_format.py and
docs/recording-format.md. Import them from here.
"""
from engine.watch.recorder import Recorder
from engine.watch.recording_format import (
    CHUNK_HEAD_SIZE,
    EVENTS,
    INDEX,
    KEYFRAME,
    RecordingError,
)
from engine.watch.recording_reader import RecordingReader

__all__ = ["CHUNK_HEAD_SIZE", "EVENTS", "INDEX", "KEYFRAME", "Recorder", "RecordingError", "RecordingReader"]
