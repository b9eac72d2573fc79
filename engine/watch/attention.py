"""Where each sequence's newest token looked, rebuilt from AttentionWeights events (published by a
context made with publish_attention=True): what a view needs to shade every cell by the attention it
received. No torch here, so a viewer without the engine can use it."""
from __future__ import annotations

import threading

import numpy as np

from engine import events as ev


class AttentionWatch:
    """The latest AttentionWeights of every sequence, as arrays aligned with a cache's cells."""

    def __init__(self) -> None:
        self._latest: dict[int, ev.AttentionWeights] = {}
        self._created: dict[str, ev.ContextCreated] = {}  # each cache's size and layers, by cache name
        self._lock = threading.Lock()
        self._subscription: ev.Subscription | None = None

    def attach(self, bus: ev.EventBus, maxsize: int = 4096) -> ev.Subscription:
        """Subscribe to the events this watch reads; call sync() to apply what arrived. The bus hands it
        each live context's ContextCreated first, so the caches' sizes are known from the start."""
        self._subscription = bus.subscribe(maxsize=maxsize, kinds=(ev.ContextCreated, ev.AttentionWeights))
        return self._subscription

    def sync(self) -> int:
        """Apply every queued event of the attached subscription; returns how many."""
        if self._subscription is None:
            raise RuntimeError("the attention watch is not attached: call attach(bus) first")
        events = self._subscription.drain()
        for event in events:
            self.apply(event)
        return len(events)

    def apply(self, event: ev.Event) -> None:
        """Take one event; kinds other than ContextCreated and AttentionWeights are ignored. A lost event
        needs no resync: each AttentionWeights replaces its sequence's weights whole."""
        with self._lock:
            if isinstance(event, ev.AttentionWeights):
                self._latest[event.seq_id] = event
            elif isinstance(event, ev.ContextCreated):
                self._created[event.cache] = event

    def seq_ids(self) -> list[int]:
        """Sequences with weights, ascending."""
        with self._lock:
            return sorted(self._latest)

    def latest(self, seq_id: int) -> ev.AttentionWeights | None:
        """The sequence's last AttentionWeights event (its step and position say which token); None: none yet."""
        with self._lock:
            return self._latest.get(seq_id)

    def weights(self, seq_id: int, cache: str, stream: int = 0, layer: int | None = None) -> np.ndarray:
        """float32 [cells per stream of `cache`]: the weight seq_id's newest token gave each cell of that
        stream in model layer `layer` (None: the mean over the cache's layers), 0 on every other cell.
        All zeros when the sequence has no weights yet or its token was in another stream.

        Raises KeyError for a cache the watch never heard of, ValueError for a layer the cache does not hold."""
        with self._lock:
            event = self._latest.get(seq_id)
            created = self._created.get(cache)
        k = None if event is None or cache not in event.caches else event.caches.index(cache)
        if created is None and k is None:
            raise KeyError(f"no cache named {cache!r} (known: {sorted(self._created)})")
        layer_ids = created.layer_ids if created is not None else event.layer_ids[k]
        if layer is not None and layer not in layer_ids:
            raise ValueError(f"cache {cache!r} holds layers {list(layer_ids)}, not layer {layer}")
        # without its ContextCreated (a watch attached with_state=False) a cache is as long as the window
        size = created.kv_size if created is not None else int(event.cells[k].max()) + 1
        out = np.zeros(size, dtype=np.float32)
        if k is None or event.streams[k] != stream:
            return out
        rows = event.weights[k]
        out[event.cells[k]] = rows.mean(axis=0) if layer is None else rows[event.layer_ids[k].index(layer)]
        return out
