"""`-ot REGEX=DEVICE`: weights overridden onto other devices (llama.cpp's --override-tensor, applied in
llama_model_base::load_tensors, src/llama-model.cpp), their accounting, the activation copies they cost, and
the refusals."""
from __future__ import annotations

import gc
import json
import logging

import pytest
import torch

import engine
from engine import events as ev
from engine.batch import Batch
from engine.cli import main
from engine.errors import DeviceSpecError
from engine.placement.devices import CPU, plan_placement, resolve_gpus
from engine.placement.weight_devices import parse_tensor_overrides, plan_weight_devices
from engine.sizing.estimate import estimate
from tests.model_factory import f32_weight_bytes, in_memory_model

F32 = 4
PROMPT = [1, 5, 9, 2, 7]
N_LAYER = 4


@pytest.fixture
def gpu():
    return resolve_gpus(["VGPU0=1GiB"])[0]


@pytest.fixture
def model():
    return in_memory_model(n_layer=N_LAYER)


def plan(model, gpu, specs, ngl=-1, offload_kqv=True):
    placement = plan_placement(model.config.n_layer, ngl, [gpu], offload_kqv=offload_kqv)
    return plan_weight_devices(model.config, placement, parse_tensor_overrides(specs, [gpu]))


# ---- parsing and planning ----------------------------------------------------------------------------------
def test_items_are_split_on_commas_and_kept_in_order(gpu):
    ot = parse_tensor_overrides([r"blk\.0\.ffn_.*=VGPU0,ffn_.*=cpu", "output=VGPU0"], [gpu])
    assert [(o.pattern, o.device.name) for o in ot] == [(r"blk\.0\.ffn_.*", "VGPU0"), ("ffn_.*", "CPU"),
                                                        ("output", "VGPU0")]


@pytest.mark.parametrize("spec, fragment", [
    ("ffn_.*=CUDA7", "unknown buffer type 'CUDA7' in tensor override 'ffn_.*=CUDA7'; available buffer types: "
                     "CPU, VGPU0 (virtual: VGPU0)"),
    ("ffn_down", "bad tensor override 'ffn_down': write REGEX=DEVICE"),
    ("=CPU", "bad tensor override '=CPU'"),
    ("ffn_(=CPU", "'ffn_(' is not a regex"),
])
def test_bad_overrides_are_refused_with_the_reason(gpu, spec, fragment):
    with pytest.raises(DeviceSpecError) as info:
        parse_tensor_overrides([spec], [gpu])
    assert fragment in str(info.value)


def test_first_matching_pattern_decides_and_kv_stays_with_the_layer(model, gpu):
    wd = plan(model, gpu, [r"blk\.0\.ffn_.*=VGPU0", "ffn_.*=CPU"])
    assert wd.layers[0].fields["w_down"] is gpu and wd.layers[0].fields["ffn_norm"] is gpu
    for layer in wd.layers[1:]:
        assert {f: d.name for f, d in layer.fields.items()} == {
            "attn_norm": "VGPU0", "wqkv": "VGPU0", "wo": "VGPU0", "ffn_norm": "CPU", "w_gate_up": "CPU",
            "w_down": "CPU"}
    assert all(layer.kv is gpu and layer.residual is gpu for layer in wd.layers)
    assert wd.tok_embd is CPU and wd.output is gpu
    overridden = dict((n, d.name) for n, d in wd.overridden)
    assert overridden["blk.0.ffn_down.weight"] == "VGPU0" and overridden["blk.3.ffn_up.weight"] == "CPU"
    assert "blk.1.attn_q.weight" not in overridden


def test_overrides_can_move_weights_onto_a_gpu_with_ngl_0(model, gpu):
    wd = plan(model, gpu, [r"blk\.3\.ffn_down=VGPU0"], ngl=0)
    assert wd.layers[3].fields["w_down"] is gpu and wd.layers[3].residual is CPU and wd.layers[3].kv is CPU


@pytest.mark.parametrize("spec", ["attn_q=CPU", r"blk\.2\.ffn_gate=CPU"])
def test_a_pattern_that_splits_a_fused_matrix_is_refused(model, gpu, spec):
    with pytest.raises(DeviceSpecError, match="kvscope stores these tensors as one matrix"):
        plan(model, gpu, [spec])


# ---- a context with overrides ----------------------------------------------------------------------------
def reference_logits(model):
    cpu = engine.Context(model, n_ctx=256)
    cpu.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True))
    out = cpu.all_logits().clone()
    cpu.decode(Batch.for_sequence([3], seq_id=0, start_pos=len(PROMPT)))
    return out, cpu.logits(0).clone()


def run(ctx):
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True)) == 0
    prefill = ctx.all_logits().clone()
    assert ctx.decode(Batch.for_sequence([3], seq_id=0, start_pos=len(PROMPT))) == 0
    return prefill, ctx.logits(0)


def test_ffn_down_on_the_cpu_costs_two_copies_per_layer_and_changes_no_logit(model, gpu):
    ref_prefill, ref_step = reference_logits(model)
    ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1, tensor_overrides=["ffn_down=CPU"])
    prefill, step = run(ctx)
    assert torch.equal(prefill, ref_prefill) and torch.equal(step, ref_step)
    cfg = model.config
    # per token: CPU -> VGPU0 before layer 0, then in every layer the MLP's hidden state to the CPU and
    # ffn_down's output back; the output layer is on VGPU0 like the last layer, its logits go to the host
    per_token = (cfg.n_embd + N_LAYER * (cfg.n_ff + cfg.n_embd) + cfg.n_vocab) * F32
    assert ctx.perf.bytes_moved == per_token * (len(PROMPT) + 1)
    # the bytes follow the tensors: ffn_down weights on the CPU, the rest of the layers on VGPU0
    down = cfg.n_ff * cfg.n_embd * F32
    layers, output = f32_weight_bytes(cfg)
    assert ctx.model_bytes_by_device[gpu] == sum(layers) - N_LAYER * down + output
    assert ctx.model_bytes_by_device[CPU] == N_LAYER * down + cfg.n_vocab * cfg.n_embd * F32  # + token_embd
    assert gpu.reserved_bytes() == (ctx.model_bytes_by_device[gpu] + ctx.kv_bytes_by_device[gpu]
                                    + ctx.compute_bytes_by_device[gpu])


def test_nkvo_runs_attention_where_the_cache_is(model, gpu):
    """-nkvo: Q, K and V go to the CPU, where K/V live and attention runs; its output comes back."""
    ref_prefill, ref_step = reference_logits(model)
    ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1, offload_kqv=False)
    prefill, step = run(ctx)
    assert torch.equal(prefill, ref_prefill) and torch.equal(step, ref_step)
    cfg = model.config
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    per_token = (cfg.n_embd + N_LAYER * (q + 2 * kv + q) + cfg.n_vocab) * F32
    assert ctx.perf.bytes_moved == per_token * (len(PROMPT) + 1)


def test_overridden_tensors_are_logged_and_published(model, gpu, caplog):
    bus = ev.EventBus()
    sub = bus.subscribe()
    with caplog.at_level(logging.DEBUG, logger="kvscope"):
        ctx = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1,
                             tensor_overrides=[r"blk\.[01]\.ffn_down=CPU"], bus=bus)
    lines = caplog.messages
    assert "tensor blk.0.ffn_down.weight (0 MiB f32) buffer type overridden to CPU" in lines
    assert "tensor blk.1.ffn_down.weight (0 MiB f32) buffer type overridden to CPU" in lines
    assert not any("blk.2.ffn_down" in line for line in lines)
    mib = {d: n / 2**20 for d, n in ctx.model_bytes_by_device.items()}
    buffer_lines = [line for line in lines if "model buffer size" in line]
    assert lines.index(buffer_lines[0]) < lines.index("llama_context: constructing llama_context")
    assert buffer_lines == [
        f"load_tensors:          CPU model buffer size = {mib[CPU]:8.2f} MiB",
        f"load_tensors: VGPU0 (virtual) model buffer size = {mib[gpu]:8.2f} MiB"]
    placed = next(e for e in sub.drain() if isinstance(e, ev.ModelPlaced))
    assert placed.overridden == (("blk.0.ffn_down.weight", "CPU"), ("blk.1.ffn_down.weight", "CPU"))
    assert dict(placed.weight_bytes) == {d.name: n for d, n in ctx.model_bytes_by_device.items()}


def test_a_refused_override_leaves_no_trace(model, gpu):
    with pytest.raises(DeviceSpecError, match="kvscope stores these tensors as one matrix"):
        engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1, tensor_overrides=["attn_v=CPU"])
    gc.collect()
    assert gpu.reserved_bytes() == 0
    assert {d.name for d in model.transformer.weight_devices.devices()} == {"CPU"}


def test_estimate_follows_the_overrides(tiny_llama_gguf):
    settings = dict(n_ctx=256, n_gpu_layers=-1, devices=resolve_gpus(["VGPU0=1GiB"]),
                    tensor_overrides=["ffn_(gate|up|down)=CPU", "output=CPU"])
    est = estimate(tiny_llama_gguf, **settings)
    ctx = engine.Context(engine.load_model(tiny_llama_gguf), **settings)
    predicted = {d.device: d.model_bytes for d in est.devices}
    assert predicted == {d.name: n for d, n in ctx.model_bytes_by_device.items()}
    assert ctx.weight_devices.output is CPU


def test_cli_takes_ot(capsys):
    argv = ["estimate", "--virtual-gpu", "VGPU0=1GiB", "-ngl", "all", "-c", "256", "--json"]

    def model_bytes() -> dict[str, int]:
        return {d["device"]: d["model_bytes"] for d in json.loads(capsys.readouterr().out)["devices"]}

    assert main([*argv, "-ot", "ffn_.*=CPU"]) == 0
    overridden = model_bytes()
    api = estimate("demo", n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB"], tensor_overrides=["ffn_.*=CPU"])
    assert overridden == {d.device: d.model_bytes for d in api.devices}
    assert main(argv) == 0
    plain = model_bytes()  # without -ot the MLP weights go to VGPU0 with their layers
    assert overridden["CPU"] > plain["CPU"] and overridden["VGPU0"] < plain["VGPU0"]
    assert main(["estimate", "--virtual-gpu", "VGPU0=1GiB", "-ngl", "all", "-ot", "ffn_.*=GPU9"]) == 1
    assert "unknown buffer type 'GPU9'" in capsys.readouterr().err
