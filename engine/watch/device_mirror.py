"""Device memory and layer placement rebuilt from events: what memory bars and the layer/device map
draw from (ModelPlaced, DeviceMemoryChanged, DeviceMemoryState)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine import events as ev

# checkpoints, prompt cache: a server's context checkpoints and its cache of saved prompts, in host memory
PARTS = ("weights", "kv", "compute", "checkpoints", "prompt cache")
OPTIONAL_PARTS = ("checkpoints", "prompt cache")  # a view names them only when some device holds any


@dataclass
class DeviceRow:
    """Bytes on one device by part, as the events told them."""

    name: str
    virtual: bool
    capacity: int | None
    reserved: int | None = None  # a virtual device's ledger, all contexts together
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    @property
    def used(self) -> int:
        return sum(self.bytes.values())

    @property
    def label(self) -> str:
        return f"{self.name} (virtual)" if self.virtual else self.name


class DeviceMirror:
    """Per device: weights, KV and compute bytes; the model's layer placement."""

    def __init__(self) -> None:
        self.rows: dict[str, DeviceRow] = {}
        self.placement: ev.ModelPlaced | None = None

    def apply(self, event: ev.Event) -> None:
        if isinstance(event, ev.ModelPlaced):
            # the weights the context uses, whether it placed them or shares another context's placement
            self.placement = event
            for name, nbytes in event.weight_bytes:
                self._row(name, virtual=False, capacity=None).bytes["weights"] = nbytes
        elif isinstance(event, ev.DeviceMemoryChanged):
            row = self._row(event.device, event.virtual, event.capacity)
            if event.what != "weights" or event.delta < 0:  # placed weights were counted from ModelPlaced
                row.bytes[event.what] = row.bytes.get(event.what, 0) + event.delta
            row.virtual, row.capacity, row.reserved = event.virtual, event.capacity, event.reserved
        elif isinstance(event, ev.DeviceMemoryState):
            self.rows = {d.device: DeviceRow(d.device, d.virtual, d.capacity, d.reserved,
                                             {"weights": d.weights, "kv": d.kv, "compute": d.compute,
                                              "checkpoints": d.checkpoints, "prompt cache": d.prompt_cache})
                         for d in event.devices}

    def state_events(self) -> list[ev.Event]:
        """Events that give a fresh DeviceMirror this one's state: the placement as received, then every
        row as a DeviceMemoryState (after the placement, which would otherwise add rows of its own)."""
        if self.placement is None and not self.rows:
            return []
        rows = ev.DeviceMemoryState(tuple(
            ev.DeviceBytes(r.name, r.virtual, r.capacity, r.reserved, r.bytes.get("weights", 0), r.bytes.get("kv", 0),
                           r.bytes.get("compute", 0), r.bytes.get("checkpoints", 0), r.bytes.get("prompt cache", 0))
            for r in self.rows.values()))
        return ([self.placement] if self.placement is not None else []) + [rows]

    def snapshot(self) -> dict:
        """Rows and the placement event, for comparing two mirrors (CacheMirror.snapshot)."""
        return {"rows": {name: {"virtual": r.virtual, "capacity": r.capacity, "reserved": r.reserved,
                                "bytes": dict(r.bytes)} for name, r in self.rows.items()},
                "placement": self.placement}

    def _row(self, name: str, virtual: bool, capacity: int | None) -> DeviceRow:
        """The device's row; a new one with these facts if none yet."""
        return self.rows.setdefault(name, DeviceRow(name, virtual, capacity))

    def layer_devices(self) -> tuple[str, ...]:
        """Each layer's device name (empty until a ModelPlaced arrived)."""
        return self.placement.layer_devices if self.placement else ()

    def layer_letters(self) -> tuple[list[tuple[str, bool]], str]:
        """The layer map as both explorers write it: per layer "C" (its weights on the CPU) or "G" (a GPU)
        and whether -ot sent one of its weights elsewhere; and the output layer's device ("" before the
        model was placed)."""
        letters = [("C" if layer.device == "CPU" else "G", bool(layer.overridden)) for layer in self.layer_map()]
        out = self.placement.output_device if self.placement else ""
        return letters, out

    def layer_map(self) -> list[LayerPlacement]:
        """One row per layer for a layer/device map: where its weights and its K/V live, and which of
        its weights an -ot pattern sent elsewhere (empty until a ModelPlaced arrived)."""
        p = self.placement
        if p is None:
            return []
        moved: dict[int, list[tuple[str, str]]] = {}
        for name, device in p.overridden:
            if name.startswith("blk."):
                moved.setdefault(int(name.split(".")[1]), []).append((name, device))
        kv = p.kv_devices or p.layer_devices
        return [LayerPlacement(il, dev, kv[il], tuple(moved.get(il, ()))) for il, dev in enumerate(p.layer_devices)]


@dataclass(frozen=True)
class LayerPlacement:
    layer: int
    device: str  # the layer's device from -ngl
    kv_device: str
    overridden: tuple[tuple[str, str], ...]  # (tensor name, device) of its weights placed elsewhere
