"""`kvscope estimate`: the bytes per device it predicts from headers equal what a real Context allocates
and reserves with the same settings."""
from __future__ import annotations

import gc
import json

import pytest

import engine
from engine.cli import main
from engine.sizing.estimate import estimate, fit

SETTINGS = {
    "default": dict(n_ctx=256),
    "q8_0_kv": dict(n_ctx=256, type_k="q8_0", type_v="q8_0", flash_attn="auto"),
    "split_streams": dict(n_ctx=768, n_seq_max=3),
    "unified": dict(n_ctx=768, n_seq_max=3, kv_unified=True),
    "swa_full": dict(n_ctx=512, n_seq_max=2, swa_full=True, n_ubatch=64),
    "nkvo_all": dict(n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB"], offload_kqv=False),
    "partial_one_gpu": dict(n_ctx=256, n_gpu_layers=3, devices=["VGPU0=1GiB"]),
    "partial_two_gpus": dict(n_ctx=512, n_gpu_layers=5, devices=["VGPU0=1GiB", "VGPU1=512MiB"],
                             tensor_split=[1, 1], type_k="q8_0", type_v="f32", pad=32),
    "two_gpus_by_capacity": dict(n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB", "VGPU1=3GiB"]),
    "ffn_overridden_to_cpu": dict(n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB"],
                                  tensor_overrides=[r"blk\.[0-3]\.ffn_.*=CPU", "token_embd=VGPU0"]),
}


def actual_bytes(ctx) -> dict[str, tuple[int, int, int]]:
    """(weights, KV, compute) bytes per device name of a live context, from the engine's own accounting."""
    weights, kv, compute = ctx.model_bytes_by_device, ctx.kv_bytes_by_device, ctx.compute_bytes_by_device
    devices = set(weights) | set(kv) | set(compute)
    return {d.name: (weights.get(d, 0), kv.get(d, 0), compute.get(d, 0)) for d in devices}


def assert_estimate_matches(path, settings, dtype="f32"):
    est = estimate(path, dtype=dtype, **settings)
    model = engine.load_model(path, dtype=dtype)
    ctx = engine.Context(model, **settings)
    try:
        actual = actual_bytes(ctx)
        predicted = {d.device: (d.model_bytes, d.kv_bytes, d.compute_bytes) for d in est.devices if d.total_bytes}
        assert predicted == actual
        # KV: the caches' buffers as allocated
        assert sum(kv for _, kv, _ in actual.values()) == sum(c.k_bytes() + c.v_bytes() for c in ctx.memory.caches())
        # virtual devices: the ledger holds exactly weights + KV + compute
        virtual = {dev for dev in placement_devices(ctx) if dev.is_virtual}
        assert len(virtual) == len(settings.get("devices", ()))  # every device given holds something
        for dev in virtual:
            row = next(d for d in est.devices if d.device == dev.name)
            assert dev.reserved_bytes() == row.total_bytes
            assert row.capacity == dev.capacity and row.free == dev.capacity
        assert est.params == ctx.params
        assert [d.name for d in est.placement.layer_devices] == [d.name for d in ctx.placement.layer_devices]
    finally:
        del ctx, model
        gc.collect()
    return est


def placement_devices(ctx):
    return list(ctx.placement.layer_devices) + [ctx.placement.output_device] + list(ctx.placement.kv_devices)


@pytest.mark.parametrize("name", SETTINGS)
def test_estimate_matches_demo_context(name):
    assert_estimate_matches("demo", SETTINGS[name])


def test_estimate_matches_hf_gemma3_two_gpus(tiny_gemma3_hf):
    assert_estimate_matches(tiny_gemma3_hf, dict(n_ctx=256, n_gpu_layers=4, pad=32, n_seq_max=2,
                                                  devices=["VGPU0=64MiB", "VGPU1=64MiB"]))


def test_estimate_matches_llama_gguf_bf16(tiny_llama_gguf):
    assert_estimate_matches(tiny_llama_gguf, dict(n_ctx=128, pad=32, n_gpu_layers=2, devices=["VGPU0=64MiB"]),
                            dtype="bf16")


def test_estimate_matches_qwen2_tied_with_biases(tiny_qwen2_hf):
    assert_estimate_matches(tiny_qwen2_hf, dict(n_ctx=128, pad=32, n_gpu_layers=1, devices=["VGPU0=64MiB"],
                                                 offload_kqv=False))


def test_estimate_reads_no_tensor_data(monkeypatch, tiny_gemma3_hf, tiny_llama_gguf):
    import gguf
    import safetensors

    from engine.formats import gguf_file, hf_folder

    def refuse(*a, **k):
        raise AssertionError("estimate must not read tensor data")

    monkeypatch.setattr(gguf_file, "dequantize_tensor", refuse)
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(hf_folder, "read_safetensors", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    for path in ("demo", tiny_gemma3_hf, tiny_llama_gguf):
        assert estimate(path, n_ctx=128, pad=32).devices[0].model_bytes > 0


def test_estimate_flags_a_device_too_small():
    est = estimate("demo", n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1MiB"])
    row = est.devices[1]
    assert row.virtual and not row.fits and not est.fits


def test_cli_estimate_json_and_table(capsys):
    settings = ["-c", "256", "-np", "3", "-ngl", "3", "--virtual-gpu", "VGPU0=1GiB", "-ctk", "q8_0"]
    assert main(["estimate", *settings, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    est = estimate("demo", n_ctx=256, n_seq_max=3, n_gpu_layers=3, devices=["VGPU0=1GiB"], type_k="q8_0")
    expected = est.to_dict()
    for d in data["devices"] + expected["devices"]:
        if d["device"] == "CPU":
            assert d.pop("free") > 0  # the host's MemAvailable, which moves between the two calls
    assert data == expected
    assert main(["estimate", *settings]) == 0
    out = capsys.readouterr().out
    assert "VGPU0 (virtual)" in out and "CPU" in out and "context MiB" in out


def test_fit_proposes_the_largest_layers_then_context():
    dev = ["VGPU0=24MiB"]  # not every layer of the demo fits
    est = fit("demo", n_ctx=256, n_seq_max=2, devices=dev)
    ngl = est.placement.n_gpu_layers
    assert est.fits and 0 < ngl <= est.config.n_layer
    assert not estimate("demo", n_ctx=256, n_seq_max=2, devices=dev, n_gpu_layers=ngl + 1).fits


def test_fit_context_is_the_largest_that_fits():
    # room for every layer and about twice the KV cache of n_ctx = 256: the context is the limit
    full = estimate("demo", n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB"]).devices[1]
    dev = [f"VGPU0={full.total_bytes + full.kv_bytes}B"]
    est = fit("demo", n_ctx=256, devices=dev)
    n_ctx = est.params.n_ctx
    assert est.fits and est.placement.n_gpu_layers == est.config.n_layer + 1
    assert 256 <= n_ctx < est.config.n_ctx_train
    assert not estimate("demo", n_ctx=n_ctx + 256, devices=dev, n_gpu_layers=-1).fits


def test_cli_estimate_fit(capsys):
    assert main(["estimate", "--fit", "-c", "256", "--virtual-gpu", "VGPU0=20MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("proposed: -ngl ") and "VGPU0 (virtual)" in out


def test_fit_leaves_the_target_free_on_every_gpu():
    dev = ["VGPU0=64MiB"]
    plain = fit("demo", n_ctx=256, devices=dev)
    margin = 32 << 20
    kept = fit("demo", n_ctx=256, devices=dev, fit_target=margin)
    gpu = next(d for d in kept.devices if d.device == "VGPU0")
    assert gpu.total_bytes + margin <= gpu.capacity
    assert kept.placement.n_gpu_layers < plain.placement.n_gpu_layers
    more = estimate("demo", n_ctx=kept.params.n_ctx, devices=dev, n_gpu_layers=kept.placement.n_gpu_layers + 1)
    assert next(d for d in more.devices if d.device == "VGPU0").total_bytes + margin > gpu.capacity


def test_fit_ctx_is_the_smallest_context_and_the_one_layers_are_fitted_at():
    dev = ["VGPU0=24MiB"]
    est = fit("demo", n_ctx=256, devices=dev, fit_ctx_min=768)
    assert est.params.n_ctx >= 768 and est.fits
    assert not estimate("demo", n_ctx=768, devices=dev, n_gpu_layers=est.placement.n_gpu_layers + 1).fits
    # 2^27 cells of K/V are more than this host has: the floor is not lowered to make something fit
    with pytest.raises(engine.ContextParamsError, match="nothing fits: even n_ctx = 134217728"):
        fit("demo", devices=["VGPU0=1MiB"], fit_ctx_min=1 << 27)


def test_cli_fit_target_and_fit_ctx(capsys):
    assert main(["estimate", "--fit", "-fitt", "32", "-fitc", "512", "--virtual-gpu", "VGPU0=64MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    gpu = next(d for d in data["devices"] if d["device"] == "VGPU0")
    assert data["n_ctx"] >= 512 and gpu["total_bytes"] + (32 << 20) <= gpu["capacity"]
