"""ModelPlaced and DeviceMemoryChanged: what a front-end without a mirror learns about device memory."""
from __future__ import annotations

import gc

import engine
from engine import events as ev
from engine.placement.devices import CPU, resolve_gpus


def memory_events(sub) -> list:
    return [e for e in sub.drain() if isinstance(e, (ev.ModelPlaced, ev.DeviceMemoryChanged))]


def test_offloaded_context_publishes_placement_reservations_and_releases():
    model = engine.load_model("demo")
    bus = ev.EventBus()
    sub = bus.subscribe()
    gpu0, gpu1 = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])
    ctx = engine.Context(model, n_ctx=256, n_gpu_layers=4, devices=[gpu0, gpu1], tensor_split=[1, 1], bus=bus)
    weights, kv, compute = dict(ctx.weight_bytes_by_device), dict(ctx.kv_bytes_by_device), dict(ctx.compute_bytes_by_device)
    events = memory_events(sub)

    placed = events[0]
    assert isinstance(placed, ev.ModelPlaced) and not placed.shared
    assert placed.layer_devices == tuple(d.name for d in ctx.placement.layer_devices)
    assert placed.output_device == ctx.placement.output_device.name
    assert dict(placed.weight_bytes) == {d.name: n for d, n in weights.items()}

    changes = [(e.device, e.what, e.delta, e.reserved, e.virtual) for e in events[1:]]
    # weights first (reserved: the weights alone), then KV (reserved: weights + KV), then compute buffers
    # (reserved: all three); real devices: None
    def virtual(d, n):
        return n if d.is_virtual else None

    assert changes == (
        [(d.name, "weights", n, virtual(d, n), d.is_virtual) for d, n in weights.items()] +
        [(d.name, "kv", n, virtual(d, weights.get(d, 0) + n), d.is_virtual) for d, n in kv.items()] +
        [(d.name, "compute", n, virtual(d, weights.get(d, 0) + kv.get(d, 0) + n), d.is_virtual)
         for d, n in compute.items()])
    assert {e.capacity for e in events[1:] if e.virtual} == {1 << 30}

    del ctx
    gc.collect()
    released = memory_events(sub)
    assert sorted((e.device, e.what, e.delta) for e in released) == sorted(
        [(d.name, "weights", -n) for d, n in weights.items()] + [(d.name, "kv", -n) for d, n in kv.items()]
        + [(d.name, "compute", -n) for d, n in compute.items()])
    assert gpu0.reserved_bytes() == gpu1.reserved_bytes() == 0
    last = {e.device: e.reserved for e in released if e.virtual}
    assert last == {"VGPU0": 0, "VGPU1": 0}


def test_cpu_context_publishes_all_cpu_placement_and_kv():
    model = engine.load_model("demo")
    bus = ev.EventBus()
    sub = bus.subscribe()
    ctx = engine.Context(model, n_ctx=256, bus=bus)
    placed, *changes = memory_events(sub)
    assert placed.layer_devices == ("CPU",) * model.config.n_layer and placed.output_device == "CPU"
    # every weight, the input embedding included, once (the tied output layer shares it), in f32
    assert dict(placed.weight_bytes) == {"CPU": model.transformer.n_params() * 4}
    assert [(e.device, e.what, e.delta, e.reserved, e.capacity) for e in changes] == [
        ("CPU", "kv", sum(c.k_bytes() + c.v_bytes() for c in ctx.memory.caches()), None, None),
        ("CPU", "compute", ctx.compute_bytes_by_device[CPU], None, None)]


def test_second_context_with_the_same_placement_shares_the_weights():
    model = engine.load_model("demo")
    (gpu,) = resolve_gpus(["VGPU0=1GiB"])
    first = engine.Context(model, n_ctx=256, n_gpu_layers=2, devices=[gpu])
    bus = ev.EventBus()
    sub = bus.subscribe()
    second = engine.Context(model, n_ctx=256, n_gpu_layers=2, devices=[gpu], bus=bus)
    placed, *changes = memory_events(sub)
    assert placed.shared
    assert [e.what for e in changes] == ["kv"] * len(second.kv_bytes_by_device) + ["compute"] * len(
        second.compute_bytes_by_device)
    last = [e for e in changes if e.device == "VGPU0"][-1]
    assert last.reserved == gpu.reserved_bytes() == (
        first.weight_bytes_by_device[gpu] + first.kv_bytes_by_device[gpu] + first.compute_bytes_by_device[gpu]
        + second.kv_bytes_by_device[gpu] + second.compute_bytes_by_device[gpu])


def mirror_rows(mirror) -> dict[str, tuple[int, int, int]]:
    return {name: (r.bytes["weights"], r.bytes["kv"], r.bytes["compute"]) for name, r in mirror.devices.rows.items()}


def breakdown_rows(ctx) -> dict[str, tuple[int, int, int]]:
    return {d.name: (mb.model, mb.context, mb.compute) for d, mb in ctx.memory_breakdown().items()}


def test_watchers_from_the_start_and_late_ones_see_the_same_device_memory():
    model = engine.load_model("demo")
    bus = ev.EventBus()
    live = engine.CacheMirror()
    live.attach(bus)
    gpu0, gpu1 = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])
    ctx = engine.Context(model, n_ctx=256, n_gpu_layers=5, devices=[gpu0, gpu1], tensor_split=[1, 1], bus=bus)
    live.sync()
    assert mirror_rows(live) == breakdown_rows(ctx)
    assert live.devices.layer_devices() == tuple(d.name for d in ctx.placement.layer_devices)
    assert live.devices.rows["VGPU1"].reserved == gpu1.reserved_bytes() and live.devices.rows["VGPU1"].virtual

    late = engine.CacheMirror()
    late.attach(bus)  # the bus hands a late watcher the context's state first
    late.sync()
    assert mirror_rows(late) == breakdown_rows(ctx)
    assert set(late.created) == {"base", "swa"} and late.created["swa"].n_swa == model.config.n_swa
    assert late.created["base"].layer_ids == ctx.memory.base.layout.layer_ids
    assert late.devices.rows["VGPU0"].reserved == gpu0.reserved_bytes()
    assert late.devices.placement.layer_devices == live.devices.placement.layer_devices


def test_a_context_sharing_the_weights_shows_them_on_its_own_bus():
    model = engine.load_model("demo")
    (gpu,) = resolve_gpus(["VGPU0=1GiB"])
    first = engine.Context(model, n_ctx=256, n_gpu_layers=3, devices=[gpu])
    bus = ev.EventBus()
    watcher = engine.CacheMirror()
    watcher.attach(bus)
    second = engine.Context(model, n_ctx=256, n_gpu_layers=3, devices=[gpu], bus=bus)
    watcher.sync()
    assert mirror_rows(watcher) == breakdown_rows(second)
    assert watcher.devices.rows["VGPU0"].reserved == gpu.reserved_bytes()  # both contexts together
    del first, second
    gc.collect()


def test_layer_map_from_events_shows_weights_kv_and_overrides():
    model = engine.load_model("demo")
    bus = ev.EventBus()
    mirror = engine.CacheMirror()
    mirror.attach(bus)
    ctx = engine.Context(model, n_ctx=256, n_gpu_layers=3, devices=["VGPU0=256MiB"], offload_kqv=False,
                         tensor_overrides=[r"blk\.5\.ffn_down=CPU"], bus=bus)
    mirror.sync()
    rows = mirror.devices.layer_map()
    assert [(r.layer, r.device, r.kv_device) for r in rows] == [
        (0, "CPU", "CPU"), (1, "CPU", "CPU"), (2, "CPU", "CPU"), (3, "CPU", "CPU"),
        (4, "VGPU0", "CPU"), (5, "VGPU0", "CPU")]  # -ngl 3: layers 4, 5 and the output; -nkvo: K/V on the CPU
    assert rows[5].overridden == (("blk.5.ffn_down.weight", "CPU"),) and rows[4].overridden == ()
    assert [d.name for d in ctx.placement.layer_devices] == [r.device for r in rows]
