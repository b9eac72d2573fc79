"""Where a context's weights, K/V and compute buffers live, and how many bytes each device gets (as
llama.cpp's `llama_model_base::load_tensors` places layers, src/llama-model.cpp, and `llama_kv_cache`'s
constructor sizes K/V buffers, src/llama-kv-cache.cpp): planned from the settings, checked against every
device's free memory before anything is reserved or moved, then committed (weights placed, virtual
ledgers reserved).
"""
from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Sequence

from engine import events as ev
from engine.errors import ContextParamsError
from engine.kv.factory import cache_layouts, kv_bytes_by_device, kv_size_by_layer
from engine.models.config import ModelConfig
from engine.models.model import Model, file_types_by_gguf_name
from engine.placement.device_memory import (
    WeightPlacement,
    check_fits,
    offloads_anything,
    reserve_until_collected,
)
from engine.placement.devices import (
    CPU,
    Device,
    Placement,
    no_gpu_warning_lines,
    plan_placement,
    resolve_gpus,
)
from engine.placement.weight_devices import (
    WeightDevices,
    model_buffer_log_lines,
    parse_tensor_overrides,
    plan_weight_devices,
    weight_tensor_sizes,
)
from engine.sizing.compute_memory import compute_bytes_by_device
from engine.sizing.memory_breakdown import (
    MemoryBreakdown,
    breakdown_by_device,
    breakdown_table,
)

log = logging.getLogger("kvscope.context")


class ContextDevices:
    """A context's devices and bytes. Building one plans and checks (a refusal leaves no trace);
    commit() makes it real."""

    def __init__(self, model: Model, cache_config: ModelConfig, params, *, devices: Sequence[Device | str] | None,
                 n_gpu_layers: int, tensor_split: Sequence[float] | None, offload_kqv: bool,
                 tensor_overrides: Sequence[str] | None) -> None:
        """cache_config: the model's config as the caches see it (another SWA window, perhaps);
        params: the context's resolved ContextParams."""
        self.model = model
        cfg, transformer = cache_config, model.transformer
        self.gpus: tuple[Device, ...] = tuple(resolve_gpus(devices))
        for line in no_gpu_warning_lines(n_gpu_layers, self.gpus, setting=f"n_gpu_layers = {n_gpu_layers}",
                                         virtual_gpu='devices=["VGPU0=2GiB"]'):
            log.warning("%s", line)
        self.placement: Placement = plan_placement(cfg.n_layer, n_gpu_layers, self.gpus, tensor_split, offload_kqv)
        self.weight_devices: WeightDevices = plan_weight_devices(
            cfg, self.placement, parse_tensor_overrides(tensor_overrides, self.gpus))
        layouts = cache_layouts(cfg, params)
        self.kv_bytes = kv_bytes_by_device(layouts, self.placement.kv_devices)
        self.compute_bytes = compute_bytes_by_device(cfg, self.weight_devices, params.n_ubatch, params.n_stream,
                                                     kv_size_by_layer(layouts), transformer.dtype)
        self.model_bytes = transformer.weight_bytes_by_device(self.weight_devices)
        self._log_placement()
        self.weights = self._existing_weight_placement()
        self.shares_weights = self.weights is not None  # placed so by another live context
        # what this context places (and, on virtual devices, reserves); empty when it shares a placement
        self.placed_weight_bytes = (dict(self.model_bytes)
                                    if self.weights is None and offloads_anything(self.weight_devices) else {})
        check_fits(self._new_bytes())

    def commit(self, owner, bus: ev.EventBus) -> None:
        """Place the weights (unless shared) and reserve K/V and compute bytes until owner is collected."""
        self.publish_model_placed(bus)
        self._undo = []
        if self.placed_weight_bytes:
            self.weights = WeightPlacement(self.model.transformer, self.weight_devices, self.placed_weight_bytes, bus)
            self.model.transformer.weight_placement = weakref.ref(self.weights)
            self._undo.append(self.weights.undo)
        self._undo.append(reserve_until_collected(owner, self.kv_bytes, "kv", bus))
        self._undo.append(reserve_until_collected(owner, self.compute_bytes, "compute", bus))

    def undo(self) -> None:
        """Release what commit() did, now: for a context that failed after committing (an exception's
        frames would otherwise keep the half-made context, and its reservations, alive)."""
        for finalizer in reversed(self._undo):
            finalizer()
        if self.placed_weight_bytes:
            self.model.transformer.weight_placement = None  # placed no more, whoever still holds it

    # ---- planning ------------------------------------------------------------------------------
    def _log_placement(self) -> None:
        cfg = self.model.config
        for line in self.placement.debug_log_lines([cfg.is_swa(il) for il in range(cfg.n_layer)]):
            log.debug("%s", line)
        if self.weight_devices.overridden:  # sizing every tensor is only needed for these lines
            sizes = weight_tensor_sizes(cfg, self.model.transformer.dtype, file_types_by_gguf_name(self.model))
            for line in self.weight_devices.override_log_lines(sizes):
                log.debug("%s", line)
        for line in self.placement.info_log_lines() + model_buffer_log_lines(self.model_bytes):
            log.info("%s", line)

    def _existing_weight_placement(self) -> WeightPlacement | None:
        """The live placement of this model's weights, if any. One that differs from ours is refused:
        the weights exist once. A context not yet garbage collected may still hold one, hence gc."""
        transformer = self.model.transformer
        for attempt in range(2):
            ref = getattr(transformer, "weight_placement", None)
            live = ref() if ref is not None else None
            if live is None:
                return None
            if live.matches(self.weight_devices):
                return live
            if attempt == 0:
                gc.collect()
        raise ContextParamsError(
            f"model {self.model.name!r} already has its weights placed on "
            f"{', '.join(str(d) for d in live.weight_devices.devices())} by another context; a context with a "
            f"different placement (n_gpu_layers, tensor_split, devices, tensor_overrides) needs that context deleted "
            f"first")

    def _new_bytes(self) -> dict[Device, dict[str, int]]:
        """Bytes this context adds per device: weights it moves off the host (or accounts on a virtual
        device), its K/V buffers and its compute buffers."""
        need: dict[Device, dict[str, int]] = {}
        for what, table in (("weights", self.placed_weight_bytes), ("kv", self.kv_bytes),
                            ("compute", self.compute_bytes)):
            for dev, nbytes in table.items():
                if what == "weights" and dev is CPU:
                    continue  # loaded into host memory already
                need.setdefault(dev, {})[what] = nbytes
        return need

    # ---- what front-ends and logs get ------------------------------------------------------------
    def breakdown(self) -> dict[Device, MemoryBreakdown]:
        return breakdown_by_device(self.model_bytes, self.kv_bytes, self.compute_bytes, self.gpus)

    def breakdown_lines(self) -> list[str]:
        return breakdown_table(self.breakdown(), self.gpus)

    def model_placed_event(self) -> ev.ModelPlaced:
        placement = self.placement
        return ev.ModelPlaced(
            model_name=self.model.name, layer_devices=tuple(d.name for d in placement.layer_devices),
            output_device=placement.output_device.name,
            weight_bytes=tuple((d.name, n) for d, n in self.model_bytes.items()),
            shared=self.shares_weights,
            overridden=tuple((name, d.name) for name, d in self.weight_devices.overridden),
            kv_devices=tuple(d.name for d in placement.kv_devices))

    def publish_model_placed(self, bus: ev.EventBus) -> None:
        if bus.active:
            bus.publish(self.model_placed_event())

    def state_events(self) -> list[ev.Event]:
        """ModelPlaced and the absolute bytes per device, for a watcher that joins late."""
        return [self.model_placed_event(), ev.DeviceMemoryState(tuple(
            ev.DeviceBytes(dev.name, dev.is_virtual, dev.capacity, dev.reserved_bytes() if dev.is_virtual else None,
                           mb.model, mb.context, mb.compute)
            for dev, mb in self.breakdown().items()))]
