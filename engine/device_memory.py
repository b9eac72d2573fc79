"""Model weights and KV bytes on devices: placing a model's weights as a placement says, and the
ledgers of virtual devices (reserve, release, and the DeviceMemoryChanged events that report them)."""
from __future__ import annotations

import weakref

from engine import events as ev
from engine.devices import CPU, Device, Placement


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

    def __init__(self, transformer, placement: Placement, weight_bytes: dict[Device, int],
                 bus: ev.EventBus | None = None) -> None:
        """bus: where the reservation and, when the placement dies, its release are published."""
        self.stages = tuple(placement.layer_devices) + (placement.output_device,)
        for dev, nbytes in weight_bytes.items():
            dev.reserve(nbytes)
        publish_memory_change(bus, weight_bytes, "weights", +1)
        transformer.place(placement.layer_devices, placement.output_device)
        weakref.finalize(self, _unplace_weights, transformer, weight_bytes, bus)

    def matches(self, placement: Placement) -> bool:
        # by identity: two virtual devices with the same name and size are still two ledgers
        wanted = tuple(placement.layer_devices) + (placement.output_device,)
        return all(a is b for a, b in zip(self.stages, wanted))


def _unplace_weights(transformer, weight_bytes: dict[Device, int], bus: ev.EventBus | None = None) -> None:
    n_layer = len(transformer.layers)
    transformer.place((CPU,) * n_layer, CPU)
    release_reservations(weight_bytes, bus, "weights")


def weight_bytes_by_device(transformer, placement: Placement) -> dict[Device, int]:
    """Bytes of model weights each device holds under placement; the input embedding is always the CPU's."""
    out: dict[Device, int] = {}
    for il, dev in enumerate(placement.layer_devices):
        out[dev] = out.get(dev, 0) + transformer.layer_weight_bytes(il)
    dev = placement.output_device
    out[dev] = out.get(dev, 0) + transformer.output_weight_bytes()
    return out


def offloads_anything(placement: Placement) -> bool:
    return any(d is not CPU for d in placement.layer_devices + (placement.output_device,))
