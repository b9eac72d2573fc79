"""Devices and layer placement (llama.cpp's `llama_model_base::load_tensors`): offload rules, log lines, virtual
devices."""
from __future__ import annotations

import gc
import itertools
import logging
import re

import pytest
import torch

import engine
from engine.batch import Batch
from engine.errors import ContextParamsError, DeviceSpecError, KvscopeError
from engine.placement.devices import (
    CPU,
    Device,
    discover_devices,
    parse_size,
    plan_placement,
    resolve_gpus,
    virtual_device,
)
from tests.model_factory import f32_weight_bytes, in_memory_model

N_LAYER = 4


def names(devices) -> list[str]:
    return [d.name for d in devices]


@pytest.fixture
def one_gpu() -> list[Device]:
    return resolve_gpus(["VGPU0=1GiB"])


@pytest.fixture
def two_gpus() -> list[Device]:
    return resolve_gpus(["VGPU0=3GiB", "VGPU1=1GiB"])


# ---- placement rules ------------------------------------------------------------------------------
def test_ngl_0_keeps_everything_on_cpu(one_gpu):
    p = plan_placement(N_LAYER, 0, one_gpu)
    assert names(p.layer_devices) == ["CPU"] * N_LAYER and p.output_device is CPU and p.input_device is CPU
    assert p.info_log_lines() == ["load_tensors: offloading 0 repeating layers to GPU",
                                  "load_tensors: offloaded 0/5 layers to GPU"]


def test_ngl_1_puts_only_the_output_layer_on_gpu(one_gpu):
    p = plan_placement(N_LAYER, 1, one_gpu)
    assert names(p.layer_devices) == ["CPU"] * N_LAYER and p.output_device.name == "VGPU0"
    assert p.i_gpu_start == N_LAYER
    assert p.info_log_lines() == ["load_tensors: offloading output layer to GPU",
                                  "load_tensors: offloading 0 repeating layers to GPU",
                                  "load_tensors: offloaded 1/5 layers to GPU"]


def test_ngl_n_layer_leaves_the_first_layer_on_cpu(one_gpu):
    p = plan_placement(N_LAYER, N_LAYER, one_gpu)
    assert names(p.layer_devices) == ["CPU", "VGPU0", "VGPU0", "VGPU0"] and p.output_device.name == "VGPU0"
    assert p.info_log_lines() == ["load_tensors: offloading output layer to GPU",
                                  "load_tensors: offloading 3 repeating layers to GPU",
                                  "load_tensors: offloaded 4/5 layers to GPU"]


@pytest.mark.parametrize("ngl", [N_LAYER + 1, -1, 999])
def test_full_offload_reports_n_layer_minus_1_repeating_layers(one_gpu, ngl):
    p = plan_placement(N_LAYER, ngl, one_gpu)
    assert names(p.layer_devices) == ["VGPU0"] * N_LAYER and p.output_device.name == "VGPU0"
    assert p.input_device is CPU and p.i_gpu_start == 0
    # QUIRK: all 4 layers are on the GPU, yet llama.cpp says 3 repeating layers.
    assert p.info_log_lines() == ["load_tensors: offloading output layer to GPU",
                                  "load_tensors: offloading 3 repeating layers to GPU",
                                  "load_tensors: offloaded 5/5 layers to GPU"]


def test_no_gpus_means_all_cpu_and_no_offload_lines():
    p = plan_placement(N_LAYER, -1, [])
    assert names(p.layer_devices) == ["CPU"] * N_LAYER and p.output_device is CPU
    assert p.info_log_lines() == []


def test_tensor_split_3_1_over_two_virtual_gpus():
    gpus = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])
    p = plan_placement(7, -1, gpus, tensor_split=[3, 1])
    # act = 8, split points 0.75, 1: (il - 0)/8 < 0.75 for il 0..5 -> VGPU0; il 6 and output -> VGPU1
    assert names(p.layer_devices) == ["VGPU0"] * 6 + ["VGPU1"] and p.output_device.name == "VGPU1"


def test_default_split_follows_virtual_capacity(two_gpus):
    p = plan_placement(7, -1, two_gpus)  # capacities 3 GiB and 1 GiB: the same as -ts 3,1
    assert names(p.layer_devices) == ["VGPU0"] * 6 + ["VGPU1"] and p.output_device.name == "VGPU1"
    assert p == plan_placement(7, -1, two_gpus, tensor_split=[0, 0])  # all zero = default


def test_partial_offload_splits_only_the_gpu_layers(two_gpus):
    p = plan_placement(7, 4, two_gpus, tensor_split=[1, 1])
    # i_gpu_start = 4, act = 4: layers 4, 5 -> VGPU0 (0/4, 1/4 < 0.5), layer 6 and output -> VGPU1
    assert names(p.layer_devices) == ["CPU"] * 4 + ["VGPU0", "VGPU0", "VGPU1"] and p.output_device.name == "VGPU1"


def test_zero_weight_gpu_gets_no_layers(two_gpus):
    p = plan_placement(N_LAYER, -1, two_gpus, tensor_split=[0, 1])
    assert names(p.layer_devices) == ["VGPU1"] * N_LAYER


def test_kv_follows_layer_device_unless_nkvo(one_gpu):
    p = plan_placement(N_LAYER, 3, one_gpu)
    assert p.kv_devices == p.layer_devices and names(p.kv_devices) == ["CPU", "CPU", "VGPU0", "VGPU0"]
    nkvo = plan_placement(N_LAYER, 3, one_gpu, offload_kqv=False)
    assert nkvo.layer_devices == p.layer_devices and names(nkvo.kv_devices) == ["CPU"] * N_LAYER


def test_debug_lines_name_each_layer_and_mark_virtual(one_gpu):
    p = plan_placement(2, 2, one_gpu)
    assert p.debug_log_lines(is_swa=[True, False]) == [
        "load_tensors: layer   0 assigned to device CPU, is_swa = 1",
        "load_tensors: layer   1 assigned to device VGPU0 (virtual), is_swa = 0",
        "load_tensors: layer   2 assigned to device VGPU0 (virtual), is_swa = 0",
    ]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n_layer=0, n_gpu_layers=1), "n_layer"),
    (dict(n_layer=4, n_gpu_layers=1, tensor_split=[1, 2]), "tensor_split has 2 values for 1 GPUs"),
    (dict(n_layer=4, n_gpu_layers=1, tensor_split=[-1]), ">= 0"),
])
def test_bad_placement_requests_are_refused(one_gpu, kwargs, fragment):
    with pytest.raises(DeviceSpecError, match=fragment):
        plan_placement(gpus=one_gpu, **kwargs)


def test_cpu_is_not_a_gpu():
    with pytest.raises(DeviceSpecError, match="CPU"):
        plan_placement(N_LAYER, 1, [CPU])


# ---- devices -------------------------------------------------------------------------------------------
def test_discovery_lists_the_cpu_first_and_only_real_devices():
    devices = discover_devices()
    assert devices[0] is CPU and str(CPU) == "CPU" and not CPU.is_virtual
    assert all(not d.is_virtual for d in devices)
    assert sum(d.kind == "cuda" for d in devices) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_virtual_device_is_labelled_and_lives_on_the_host():
    dev = virtual_device("VGPU0=2GiB")
    assert dev.is_virtual and dev.kind == "virtual" and dev.is_gpu
    assert str(dev) == "VGPU0 (virtual)" and "virtual" in repr(dev)
    assert dev.torch_device == torch.device("cpu") and dev.capacity == 2 << 30


@pytest.mark.parametrize("text, nbytes", [("512B", 512), ("4KiB", 4096), ("3MiB", 3 << 20), ("1.5GiB", 3 << 29),
                                          (" 2 GiB ", 2 << 30)])
def test_sizes_parse_in_binary_units(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("spec, fragment", [
    ("VGPU0", "NAME=SIZE"), ("=2GiB", "NAME=SIZE"), ("VGPU0=2GB", "bad size"), ("VGPU0=lots", "NAME=SIZE"),
    ("VGPU0=0B", "above 0"), ("CPU=1GiB", "already used"), ("0GPU=1GiB", "NAME=SIZE"),
])
def test_bad_virtual_specs_are_refused(spec, fragment):
    with pytest.raises(DeviceSpecError, match=fragment) as info:
        resolve_gpus([spec])
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvscopeError)


def test_duplicate_virtual_names_are_refused():
    with pytest.raises(DeviceSpecError, match="already used"):
        resolve_gpus(["VGPU0=1GiB", "vgpu0=2GiB"])


def test_virtual_memory_is_accounted_against_capacity():
    dev = virtual_device("VGPU0=1KiB")
    dev.reserve(1000)
    assert dev.free_bytes() == 24 and dev.reserved_bytes() == 1000
    with pytest.raises(DeviceSpecError, match="VGPU0 \\(virtual\\): 25 bytes needed but only 24 free"):
        dev.reserve(25)
    dev.release(1000)
    assert dev.free_bytes() == 1024


# ---- a context's KV cache follows the placement ------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return in_memory_model()


def model_weight_bytes(model) -> int:
    """Every layer's weights plus the output layer's: what a full offload puts on one GPU."""
    layers, output = f32_weight_bytes(model.config)
    return sum(layers) + output


def context_bytes(ctx, dev) -> int:
    """What a context itself reserves on a device: its K/V and compute buffers."""
    return ctx.kv_bytes_by_device.get(dev, 0) + ctx.compute_bytes_by_device.get(dev, 0)


def compute_bytes_on(model, dev_spec: str, **kwargs) -> int:
    """Compute buffer bytes a context would reserve on a virtual GPU, from a probe on a large one."""
    probe_gpu = virtual_device(dev_spec.split("=")[0] + "=1GiB")
    probe = engine.Context(model, devices=[probe_gpu], **kwargs)
    nbytes = probe.compute_bytes_by_device.get(probe_gpu, 0)
    del probe
    gc.collect()
    return nbytes


def cache_devices(ctx) -> dict[int, str]:
    """model layer -> the name of the device its K/V live on."""
    return {il: dev.name for cache in ctx.memory.caches()
            for il, dev in zip(cache.layout.layer_ids, cache.layer_devices)}


def test_defaults_keep_everything_on_the_cpu(model):
    ctx = engine.Context(model, n_ctx=256)
    assert set(cache_devices(ctx).values()) == {"CPU"} and ctx.placement.output_device is CPU
    assert all(rows.device == torch.device("cpu") for rows in ctx.memory.k + ctx.memory.v)


def test_kv_cache_layers_follow_the_plan(model):
    n_layer = model.config.n_layer
    gpus = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])
    ctx = engine.Context(model, n_ctx=256, devices=gpus, n_gpu_layers=n_layer, tensor_split=[1, 1])
    expected = plan_placement(n_layer, n_layer, gpus, [1, 1])
    assert cache_devices(ctx) == {il: d.name for il, d in enumerate(expected.kv_devices)}
    assert cache_devices(ctx)[0] == "CPU"  # ngl = n_layer leaves layer 0 on the CPU
    # virtual devices hold their share on the host and are accounted there
    assert all(rows.device == torch.device("cpu") for rows in ctx.memory.k + ctx.memory.v)
    per_layer = ctx.memory.layout.layer_buffer_bytes()
    for gpu in gpus:
        n_on_gpu = sum(d is gpu for d in expected.kv_devices)
        assert ctx.kv_bytes_by_device.get(gpu, 0) == n_on_gpu * per_layer
        assert gpu.reserved_bytes() == (n_on_gpu * per_layer + ctx.weight_bytes_by_device.get(gpu, 0)
                                        + ctx.compute_bytes_by_device.get(gpu, 0))
    assert ctx.decode(Batch.for_sequence([1, 2, 3], seq_id=0, start_pos=0)) == 0


def test_nkvo_keeps_kv_on_the_cpu_and_reserves_nothing(model):
    weights = model_weight_bytes(model)
    compute = compute_bytes_on(model, "VGPU0", n_ctx=256, n_gpu_layers=-1, offload_kqv=False)
    # room for the weights and the compute buffers only: -nkvo keeps the KV (and attention) on the CPU
    gpu = virtual_device(f"VGPU0={weights + compute}B")
    ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1, offload_kqv=False)
    assert set(cache_devices(ctx).values()) == {"CPU"} and ctx.placement.output_device is gpu
    cfg = model.config
    assert ctx.kv_bytes_by_device == {CPU: cfg.n_layer * 2 * 256 * cfg.n_head_kv * cfg.head_dim * 2}  # K and V, f16
    assert gpu.reserved_bytes() == weights + compute and gpu.free_bytes() == 0


def test_kv_that_does_not_fit_a_virtual_device_is_refused_before_allocating(model, monkeypatch):
    small, big = virtual_device("VGPU0=1KiB"), virtual_device("VGPU1=1GiB")

    def no_allocation(*args, **kwargs):
        raise AssertionError("the cache was built although the context is refused")

    monkeypatch.setattr("engine.context.build_memory", no_allocation)
    with pytest.raises(ContextParamsError) as info:
        engine.Context(model, n_ctx=256, devices=[small, big], n_gpu_layers=-1, tensor_split=[1, 1])
    message = str(info.value)
    assert "VGPU0 (virtual)" in message and "only 1024 bytes are free" in message
    need = int(re.search(r"needs? (\d+) bytes on VGPU0", message).group(1))
    assert need > 1024
    assert small.reserved_bytes() == big.reserved_bytes() == 0  # nothing reserved on either device


def test_reservations_add_up_and_are_released_with_the_context(model):
    probe = engine.Context(model, n_ctx=256)
    kv = probe.kv_bytes_by_device[CPU]
    del probe
    compute = compute_bytes_on(model, "VGPU0", n_ctx=256, n_gpu_layers=-1)
    weights = model_weight_bytes(model)  # reserved once: the contexts share the model's weights
    own = kv + compute  # each context has its own cache and compute buffers
    gpu = virtual_device(f"VGPU0={weights + own + own // 2}B")  # room for one context, not two
    first = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    assert gpu.free_bytes() == own // 2
    with pytest.raises(ContextParamsError, match=f"the KV cache \\({kv} bytes\\) and compute buffers \\({compute} "
                                                 f"bytes\\) need {own} bytes on VGPU0 \\(virtual\\) but only {own // 2}"):
        engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    del first
    gc.collect()
    assert gpu.free_bytes() == gpu.capacity
    engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1)


def test_device_names_and_specs_are_accepted_and_bad_ones_refused(model):
    ctx = engine.Context(model, n_ctx=256, devices=["VGPU7=1GiB"], n_gpu_layers=1)
    assert str(ctx.placement.output_device) == "VGPU7 (virtual)"
    with pytest.raises(DeviceSpecError, match="unknown device 'NOPE0'; available: CPU"):
        engine.Context(model, n_ctx=256, devices=["NOPE0"], n_gpu_layers=1)
    with pytest.raises(DeviceSpecError, match="CPU cannot be an offload device"):
        engine.Context(model, n_ctx=256, devices=["CPU"], n_gpu_layers=1)
    with pytest.raises(DeviceSpecError, match="listed twice"):
        gpu = virtual_device("VGPU0=1GiB")
        engine.Context(model, n_ctx=256, devices=[gpu, gpu], n_gpu_layers=1)


def test_placement_lines_are_logged(model, caplog):
    with caplog.at_level(logging.DEBUG, logger="kvscope"):
        engine.Context(model, n_ctx=256, devices=["VGPU0=1GiB"], n_gpu_layers=-1)
    n = model.config.n_layer
    assert "load_tensors: offloading output layer to GPU" in caplog.text
    assert f"load_tensors: offloaded {n + 1}/{n + 1} layers to GPU" in caplog.text
    assert f"load_tensors: layer {n:3d} assigned to device VGPU0 (virtual), is_swa = 0" in caplog.text


def api_no_gpu_warning(n_gpu_layers) -> list[str]:
    return [f"warning: no usable GPU found, n_gpu_layers = {n_gpu_layers} will be ignored",
            "warning: one possible reason is that torch was installed without GPU support (a CPU-only build)",
            'warning: to offload layers without a GPU, add a virtual one: devices=["VGPU0=2GiB"]']


def warnings_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("kwargs", [dict(n_gpu_layers=4), dict(n_gpu_layers=-1), dict(n_gpu_layers=2, devices=[])])
def test_gpu_layers_without_a_gpu_are_ignored_with_llama_cpps_warning(model, kwargs, monkeypatch, caplog):
    monkeypatch.setattr("engine.placement.devices.discover_devices", lambda: [CPU])
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        ctx = engine.Context(model, n_ctx=256, **kwargs)
    assert set(ctx.placement.layer_devices) == {CPU} and ctx.placement.output_device is CPU
    assert warnings_logged(caplog) == api_no_gpu_warning(kwargs["n_gpu_layers"])


def test_offload_layers_env_without_a_gpu_warns_in_the_api_too(model, monkeypatch, caplog):
    from engine.sizing.estimate import estimate

    monkeypatch.setattr("engine.placement.devices.discover_devices", lambda: [CPU])
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "3")
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        engine.Context(model, n_ctx=256)
        estimate("demo", n_ctx=256)
    assert warnings_logged(caplog) == api_no_gpu_warning(3) * 2


@pytest.mark.parametrize("kwargs", [dict(), dict(n_gpu_layers=0), dict(n_gpu_layers=2, devices=["VGPU0=1GiB"])])
def test_no_gpu_warning_when_no_layer_is_ignored(model, kwargs, monkeypatch, caplog):
    monkeypatch.setattr("engine.placement.devices.discover_devices", lambda: [CPU])
    monkeypatch.delenv("LLAMA_OFFLOAD_LAYERS", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        engine.Context(model, n_ctx=256, **kwargs)
    assert not warnings_logged(caplog)


# ---- KV buffers per device (llama_kv_cache's constructor, src/llama-kv-cache.cpp) -------------------------
def test_init_lines_show_one_kv_buffer_per_device_sorted_by_name(model):
    gpu = virtual_device("VGPU0=1GiB")
    ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=model.config.n_layer)  # layer 0 on the CPU
    per_layer_mib = ctx.memory.layout.layer_buffer_bytes() / 2 ** 20
    assert [line for line in ctx.init_log_lines if "KV buffer size" in line] == [
        f"llama_kv_cache:        CPU KV buffer size = {per_layer_mib:8.2f} MiB",
        f"llama_kv_cache: VGPU0 (virtual) KV buffer size = {per_layer_mib * (model.config.n_layer - 1):8.2f} MiB",
    ]


def test_cuda_buffers_are_128_aligned_and_pad_quantized_rows_to_512_values():
    from engine.kv.layout import CacheLayout
    from engine.kv.types import cache_type

    cuda = Device("CUDA0", "cuda", torch.device("cuda", 0))  # sizes only: nothing is allocated
    lo = CacheLayout(layer_ids=(0, 1), n_embd_k=96, n_embd_v=96, n_head_kv=1, head_dim=96, kv_size=256, n_stream=1,
                     n_seq_max=1, type_k=cache_type("q8_0"), type_v=cache_type("f16"), v_trans=False)
    k_cpu, v_cpu = 256 * 3 * 34, 256 * 96 * 2  # 3 q8_0 blocks of 34 bytes; 96 f16 values
    k_cuda = (k_cpu + (512 - 96) // 32 * 34 + 127) // 128 * 128  # once per tensor: a row of 416 more values
    assert lo.buffer_bytes_by_device([CPU, cuda]) == {CPU: k_cpu + v_cpu, cuda: k_cuda + v_cpu}
    assert k_cuda == 26624


def test_torch_devices_map_to_llama_cpp_names():
    from engine.placement.devices import as_device

    assert as_device("cpu") is CPU and as_device(torch.device("cpu")) is CPU
    assert as_device("cuda:1").name == "CUDA1" and as_device("cuda").name == "CUDA0"
    gpu = virtual_device("VGPU0=1GiB")
    assert as_device(gpu) is gpu


# ---- model weights follow the placement; activations cross device boundaries -------------------------------
F32 = 4
PROMPT = [1, 5, 9, 2, 7]


@pytest.fixture
def model4():
    """A fresh 4-layer model per test: weight placement is a property of the model, shared by its contexts."""
    return in_memory_model(n_layer=4)


def expected_weight_bytes(model, placement) -> dict[str, int]:
    (layers, output), out = f32_weight_bytes(model.config), {}
    for il, dev in enumerate(placement.layer_devices):
        out[dev.name] = out.get(dev.name, 0) + layers[il]
    out[placement.output_device.name] = out.get(placement.output_device.name, 0) + output
    return out


def expected_bytes_moved(model, placement, n_tokens: int, n_outputs: int) -> int:
    """Every token's activation crosses each boundary between consecutive layers' devices (the input
    embedding is on the CPU); only the output rows cross into the output layer's device, and their
    logits (float32) back to the host when that device is not the CPU."""
    stages = ["CPU"] + [d.name for d in placement.layer_devices]
    layer_crossings = sum(a != b for a, b in itertools.pairwise(stages))
    output_crossing = int(placement.output_device.name != stages[-1])
    logits_to_host = int(placement.output_device.name != "CPU") * n_outputs * model.config.n_vocab * F32
    return (layer_crossings * n_tokens + output_crossing * n_outputs) * model.config.n_embd * F32 + logits_to_host


def test_each_device_reserves_its_layer_weights_and_kv(model4):
    gpus = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])
    ctx = engine.Context(model4, n_ctx=256, devices=gpus, n_gpu_layers=-1, tensor_split=[1, 1])
    weights = expected_weight_bytes(model4, ctx.placement)
    assert names(ctx.placement.layer_devices) == ["VGPU0", "VGPU0", "VGPU0", "VGPU1"]
    for gpu in gpus:
        assert gpu.reserved_bytes() == weights[gpu.name] + context_bytes(ctx, gpu)
    # virtual: the bytes are accounted on the device, the tensors stay in host memory
    assert all(t.device == torch.device("cpu") for layer in model4.transformer.layers
               for t in vars(layer).values() if t is not None)
    del ctx
    gc.collect()
    assert gpus[0].reserved_bytes() == gpus[1].reserved_bytes() == 0
    # back on the CPU: no boundaries left
    assert {d.name for d in model4.transformer.weight_devices.devices()} == {"CPU"}


def test_weights_that_do_not_fit_are_refused_before_anything_is_reserved(model4, monkeypatch):
    probe = engine.Context(model4, n_ctx=256)
    kv = probe.kv_bytes_by_device[CPU]
    del probe
    plan = plan_placement(4, -1, [virtual_device("VGPU9=1GiB")])
    weights = expected_weight_bytes(model4, plan)["VGPU9"]
    compute = compute_bytes_on(model4, "VGPU9", n_ctx=256, n_gpu_layers=-1)
    gpu = virtual_device(f"VGPU0={weights + kv + compute - 1}B")  # one byte short

    def no_placement(*args, **kwargs):
        raise AssertionError("weights were moved although the context is refused")

    monkeypatch.setattr(type(model4.transformer), "place", no_placement)
    with pytest.raises(ContextParamsError) as info:
        engine.Context(model4, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    total = weights + kv + compute
    assert str(info.value).startswith(f"weights ({weights} bytes), the KV cache ({kv} bytes) and compute buffers "
                                      f"({compute} bytes) need {total} bytes on VGPU0 (virtual) but only {total - 1} "
                                      f"bytes are free (capacity {total - 1}); use a smaller n_ctx")
    assert gpu.reserved_bytes() == 0


@pytest.mark.parametrize("ngl, split", [(0, None), (2, None), (4, None), (-1, [1, 1])])
def test_bytes_moved_per_token_follow_the_plan(model4, ngl, split):
    gpus = resolve_gpus(["VGPU0=1GiB", "VGPU1=1GiB"])[: 1 if split is None else 2]
    ctx = engine.Context(model4, n_ctx=256, devices=gpus, n_gpu_layers=ngl, tensor_split=split)
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0)) == 0
    assert ctx.decode(Batch.for_sequence([3], seq_id=0, start_pos=len(PROMPT))) == 0
    expected = (expected_bytes_moved(model4, ctx.placement, len(PROMPT), 1)
                + expected_bytes_moved(model4, ctx.placement, 1, 1))
    assert ctx.perf.bytes_moved == expected
    assert ctx.perf.n_tokens_computed == len(PROMPT) + 1
    assert ctx.perf.bytes_moved_per_token == expected / (len(PROMPT) + 1)


def test_half_offload_moves_one_activation_row_per_token_and_two_gpus_two(model4):
    n_embd = model4.config.n_embd
    logits = model4.config.n_vocab * F32 / len(PROMPT)  # one output row's logits back to the host
    ctx = engine.Context(model4, n_ctx=256, devices=["VGPU0=1GiB"], n_gpu_layers=2)  # layer 3 + output on the GPU
    ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0))
    assert ctx.perf.bytes_moved_per_token == 1 * n_embd * F32 + logits  # CPU -> VGPU0 before layer 3
    del ctx
    ctx = engine.Context(model4, n_ctx=256, devices=["VGPU0=1GiB", "VGPU1=1GiB"], n_gpu_layers=-1,
                         tensor_split=[1, 1])
    ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0))
    assert ctx.perf.bytes_moved_per_token == 2 * n_embd * F32 + logits  # CPU -> VGPU0 at 0, VGPU0 -> VGPU1 at 3


@pytest.mark.parametrize("ngl", [2, 4, -1])
def test_logits_match_the_all_cpu_run(model4, ngl):
    cpu = engine.Context(model4, n_ctx=256)
    cpu.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True))
    reference = cpu.all_logits().clone()
    del cpu
    ctx = engine.Context(model4, n_ctx=256, devices=["VGPU0=1GiB"], n_gpu_layers=ngl)
    ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True))
    assert torch.equal(ctx.all_logits(), reference)


def test_contexts_share_one_weight_placement_and_refuse_another(model4):
    gpu = virtual_device("VGPU0=1GiB")
    first = engine.Context(model4, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    weights = first.weight_bytes_by_device[gpu]  # the CPU keeps the input embedding
    second = engine.Context(model4, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    assert second.weights is first.weights and second.weight_bytes_by_device == {}
    assert gpu.reserved_bytes() == weights + context_bytes(first, gpu) + context_bytes(second, gpu)
    with pytest.raises(ContextParamsError, match="already has its weights placed on CPU, VGPU0 \\(virtual\\)"):
        engine.Context(model4, n_ctx=256, devices=[gpu], n_gpu_layers=2)
    with pytest.raises(ContextParamsError, match="already has its weights placed"):
        engine.Context(model4, n_ctx=256)  # all-CPU is a different placement too
    del first, second
    engine.Context(model4, n_ctx=256, devices=[gpu], n_gpu_layers=2)  # refused no more once they are gone


def test_tied_output_embedding_counts_on_the_output_device_and_input_stays_on_the_cpu():
    model = in_memory_model(n_layer=4, tie_word_embeddings=True)
    output_bytes = (model.config.n_vocab + 1) * model.config.n_embd * F32  # the embedding, duplicated, + the norm
    cpu = engine.Context(model, n_ctx=256)
    cpu.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True))
    reference = cpu.all_logits().clone()
    del cpu
    gpu = virtual_device("VGPU0=1GiB")
    ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=1)  # only the output layer
    assert gpu.reserved_bytes() == output_bytes + context_bytes(ctx, gpu)
    assert gpu not in ctx.kv_bytes_by_device  # no layer's K/V there: only the output layer
    ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True))
    assert torch.equal(ctx.all_logits(), reference)
    # every row is an output here: each crosses to VGPU0 and its logits come back
    assert ctx.perf.bytes_moved == len(PROMPT) * (model.config.n_embd + model.config.n_vocab) * F32


def test_kv_cache_logs_each_layers_device_or_filtered_at_debug(caplog):
    """llama_kv_cache's per-layer debug lines (its constructor), before each cache's buffer lines."""
    model = engine.load_model("demo")  # gemma3: layers 0-4 sliding, layer 5 full
    with caplog.at_level(logging.DEBUG, logger="kvscope"):
        ctx = engine.Context(model, n_ctx=256, devices=["VGPU0=256MiB"], n_gpu_layers=4)  # layers 3-5 + output
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("llama_kv_cache")]
    vgpu = "VGPU0 (virtual)"
    base = [f"llama_kv_cache: layer {il:3d}: filtered" for il in range(5)] + [f"llama_kv_cache: layer   5: dev = {vgpu}"]
    swa = ([f"llama_kv_cache: layer {il:3d}: dev = CPU" for il in range(3)]
           + [f"llama_kv_cache: layer {il:3d}: dev = {vgpu}" for il in (3, 4)] + ["llama_kv_cache: layer   5: filtered"])
    first_base = lines.index("llama_kv_cache_iswa: creating non-SWA KV cache, size = 256 cells")
    assert lines[first_base + 1:first_base + 7] == base
    assert lines[first_base + 7].startswith("llama_kv_cache: VGPU0 (virtual) KV buffer size")
    first_swa = next(i for i, line in enumerate(lines) if line.startswith("llama_kv_cache_iswa: creating     SWA"))
    assert lines[first_swa + 1:first_swa + 7] == swa
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels[base[0]] == logging.DEBUG and levels[lines[first_base + 7]] == logging.INFO
    # with -nkvo every layer's K/V is on the CPU, and the info lines stay what ContextCreated carries
    assert not any(re.match(r"llama_kv_cache: layer +\d+:", line) for line in ctx.init_log_lines)
    del ctx
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvscope"):
        engine.Context(model, n_ctx=256, devices=["VGPU0=256MiB"], n_gpu_layers=4, offload_kqv=False)
    assert "llama_kv_cache: layer   4: dev = CPU" in caplog.messages


def test_a_cache_torch_cannot_allocate_leaves_nothing_placed_or_reserved(monkeypatch):
    """Free memory looked sufficient, then the allocation itself failed (another process took the
    memory): the weights go back and every reservation is released at once, not at garbage collection."""
    model = in_memory_model(n_layer=4)
    gpu = virtual_device("VGPU0=1GiB")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("engine.context.build_memory", out_of_memory)
    with pytest.raises(ContextParamsError, match="the KV cache could not be allocated .*CUDA out of memory") as info:
        engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    assert info.traceback  # the half-made context is still referenced from the exception's frames
    assert gpu.reserved_bytes() == 0
    assert {d.name for d in model.transformer.weight_devices.devices()} == {"CPU"}
    monkeypatch.undo()
    engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=2)  # another placement is free to go
