"""Model weights and KV bytes on devices: placing a model's weights as a placement says, and the
ledgers of virtual devices (reserve, release, and the DeviceMemoryChanged events that report them)."""
from __future__ import annotations

import weakref

from engine import events as ev
from engine.devices import CPU, Device
from engine.weight_devices import WeightDevices


def release_reservations(reserved: dict[Device, int], bus: ev.EventBus | None = None, what: str = "kv") -> None:
    for dev, nbytes in reserved.items():
        dev.release(nbytes)
    publish_memory_change(bus, reserved, what, -1)


def publish_memory_change(bus: ev.EventBus | None, nbytes_by_device: dict[Device, int], what: str, sign: int) -> None:
    """One DeviceMemoryChanged per device, after its ledger changed: sign +1 for bytes placed, -1 freed."""
    if bus is None or not bus.active:
        return
    for dev, nbytes in nbytes_by_device.items():
        if nbytes:
            bus.publish(ev.DeviceMemoryChanged(
                device=dev.name, virtual=dev.is_virtual, capacity=dev.capacity,
                reserved=dev.reserved_bytes() if dev.is_virtual else None, what=what, delta=sign * nbytes))


class WeightPlacement:
    """A model's weights placed on devices (spec section 12), shared by every context that asks for
    the same placement: weights exist once per model. Virtual devices account the weight bytes until
    the last such context is garbage collected; then the weights go back to the CPU."""

    def __init__(self, transformer, weight_devices: WeightDevices, weight_bytes: dict[Device, int],
                 bus: ev.EventBus | None = None) -> None:
        """weight_bytes: what each device gets (accounted on virtual ones). bus: where the reservation
        and, when the placement dies, its release are published."""
        self.weight_devices = weight_devices
        for dev, nbytes in weight_bytes.items():
            dev.reserve(nbytes)
        publish_memory_change(bus, weight_bytes, "weights", +1)
        transformer.place(weight_devices)
        weakref.finalize(self, _unplace_weights, transformer, weight_bytes, bus)

    def matches(self, weight_devices: WeightDevices) -> bool:
        # by identity: two virtual devices with the same name and size are still two ledgers
        return all(a is b for a, b in zip(_stages(self.weight_devices), _stages(weight_devices)))


def _stages(wd: WeightDevices) -> list[Device]:
    return [wd.tok_embd, *(d for layer in wd.layers for d in (layer.residual, *layer.fields.values())),
            wd.output_norm, wd.output]


def _unplace_weights(transformer, weight_bytes: dict[Device, int], bus: ev.EventBus | None = None) -> None:
    transformer.place(None)
    release_reservations(weight_bytes, bus, "weights")


def offloads_anything(wd: WeightDevices) -> bool:
    return any(d is not CPU for d in _stages(wd))
