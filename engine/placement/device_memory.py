"""Model weights and KV bytes on devices: placing a model's weights as a placement says, and the
ledgers of virtual devices (reserve, release, and the DeviceMemoryChanged events that report them)."""
from __future__ import annotations

import weakref

from engine import events as ev
from engine.errors import ContextParamsError
from engine.placement.devices import CPU, Device
from engine.placement.weight_devices import WeightDevices


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


NEED_LABELS = {"weights": "weights", "kv": "the KV cache", "compute": "compute buffers"}


def check_fits(need: dict[Device, dict[str, int]]) -> None:
    """Refuse what does not fit, before anything is reserved or allocated. need[dev][what]: bytes
    new to dev, what in NEED_LABELS. Free memory: a virtual device's ledger, a CUDA device's driver
    figure, the host's MemAvailable; devices that cannot tell (MPS) are not checked."""
    for dev, parts in need.items():
        total = sum(parts.values())
        free = dev.free_bytes() if total else None
        if free is None or total <= free:
            continue
        named = [f"{NEED_LABELS[what]} ({n} bytes)" for what, n in parts.items() if n]
        what = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
        capacity = f" (capacity {dev.capacity})" if dev.capacity is not None else ""
        raise ContextParamsError(
            f"{what} need {total} bytes on {dev} but only {free} bytes are free{capacity}; use a smaller n_ctx "
            f"(-c) or n_ubatch (-ub), a quantized cache type (-ctk/-ctv), fewer n_gpu_layers (-ngl), "
            f"offload_kqv=False (-nkvo), or a larger device")


def reserve_until_collected(owner, bytes_by_device: dict[Device, int], what: str,
                            bus: ev.EventBus | None) -> weakref.finalize:
    """Account bytes on virtual devices until owner is garbage collected (or the returned finalizer
    is called), and publish both changes. Real devices get the events too (their buffers are
    allocated by torch); their ledgers stay 0."""
    for dev, nbytes in bytes_by_device.items():
        dev.reserve(nbytes)
    publish_memory_change(bus, bytes_by_device, what, +1)
    return weakref.finalize(owner, release_reservations, dict(bytes_by_device), bus, what)


class WeightPlacement:
    """A model's weights placed on devices (as `llama_model_base::load_tensors` places them), shared by every
    context that asks for the same placement: weights exist once per model. Virtual devices account the
    weight bytes until the last such context is garbage collected; then the weights go back to the CPU."""

    def __init__(self, transformer, weight_devices: WeightDevices, weight_bytes: dict[Device, int],
                 bus: ev.EventBus | None = None) -> None:
        """weight_bytes: what each device gets (accounted on virtual ones). bus: where the reservation
        and, when the placement dies, its release are published."""
        self.weight_devices = weight_devices
        for dev, nbytes in weight_bytes.items():
            dev.reserve(nbytes)
        publish_memory_change(bus, weight_bytes, "weights", +1)
        transformer.place(weight_devices)
        self.undo = weakref.finalize(self, _unplace_weights, transformer, weight_bytes, bus)

    def matches(self, weight_devices: WeightDevices) -> bool:
        return all(_same_device(a, b) for a, b in zip(_stages(self.weight_devices), _stages(weight_devices)))


def _same_device(a: Device, b: Device) -> bool:
    # virtual devices by identity (two of the same name and size are still two ledgers); real ones by
    # name, since device discovery makes new Device objects on every call
    return a is b or (not a.is_virtual and not b.is_virtual and a.name == b.name)


def _stages(wd: WeightDevices) -> list[Device]:
    return [wd.tok_embd, *(d for layer in wd.layers for d in (layer.residual, *layer.fields.values())),
            wd.output_norm, wd.output]


def _unplace_weights(transformer, weight_bytes: dict[Device, int], bus: ev.EventBus | None = None) -> None:
    transformer.place(None)
    release_reservations(weight_bytes, bus, "weights")


def offloads_anything(wd: WeightDevices) -> bool:
    return any(d is not CPU for d in _stages(wd))
