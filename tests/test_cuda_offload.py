"""Layer offload to a real CUDA GPU (llama.cpp's -ngl, llama_model_base::load_tensors in src/llama-model.cpp):
the CUDA twins of tests/test_devices.py's virtual-device tests. A virtual device keeps every tensor in
host memory, so only a real GPU shows that weights and K/V really move, that activations cross between
torch devices correctly, and that the free-memory check reads the driver. Without CUDA every test here
is skipped, with the reason shown."""
from __future__ import annotations

import gc
import re

import pytest
import torch

import engine
from engine.batch import Batch
from engine.errors import KvscopeError
from engine.sizing.estimate import estimate
from tests.model_factory import in_memory_model
from tests.test_devices import (
    expected_bytes_moved,  # the same plan, counted the same way
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: torch.cuda.is_available() is False (these run on a GPU machine; see tools/gpu_check.sh)")

GPU = "CUDA0"
F32 = 4
PROMPT = [1, 5, 9, 2, 7, 11, 4, 8, 3, 6, 10, 12]  # longer than the gemma3 window (8): the window slides
STEPS = [13, 2, 40, 7, 21, 5]  # fixed tokens, so that a small logit difference cannot change the path
ATOL = 1e-4


@pytest.fixture(autouse=True)
def exact_f32_matmul():
    """TF32 would move CUDA logits ~1e-3 from the CPU's, which says nothing about placement."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(params=["llama", "gemma3"])
def model(request):
    """A fresh model per test (weight placement belongs to the model): a 4-layer llama, and the 6-layer
    iSWA gemma3 whose sliding and full-attention layers live in two caches."""
    if request.param == "llama":
        return in_memory_model(n_layer=4)
    return engine.load_model(request.getfixturevalue("tiny_gemma3_hf"))


def half(model) -> int:
    """-ngl that puts the upper half of the repeating layers and the output layer on the GPU."""
    return model.config.n_layer // 2 + 1


def run_steps(model, **settings) -> list[torch.Tensor]:
    """All prompt logits, then the logits of each cached decode step; the context is gone on return,
    so that the next call may place the weights another way."""
    ctx = engine.Context(model, n_ctx=256, **settings)
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0, all_logits=True)) == 0, ctx.last_error
    out = [ctx.all_logits().clone()]
    for i, token in enumerate(STEPS):
        assert ctx.decode(Batch.for_sequence([token], seq_id=0, start_pos=len(PROMPT) + i)) == 0, ctx.last_error
        out.append(ctx.logits(-1).clone())
    assert all(t.device.type == "cpu" for t in out)  # logits are read on the host whatever the placement
    del ctx
    gc.collect()
    return out


def assert_close_steps(actual: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(actual) == len(reference)
    for step, (a, r) in enumerate(zip(actual, reference)):
        diff = (a - r).abs().max().item()
        assert diff <= ATOL, f"step {step}: logits differ by {diff:.2e} from the all-CPU run"


def weight_tensors(model) -> dict[str, list[torch.Tensor]]:
    """Every weight tensor by owner: "layer N", "output" and "input"."""
    tf = model.transformer
    out = {f"layer {il}": [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
           for il, layer in enumerate(tf.layers)}
    out["output"] = [t for t in (tf.norm, tf.lm_head, tf.output_embd) if t is not None]
    out["input"] = [tf.tok_embd]
    return out


def kv_tensors(ctx) -> list[tuple[int, torch.Tensor]]:
    """(model layer, K or V storage tensor) for every layer of every cache."""
    return [(il, rows.data) for cache in ctx.memory.caches()
            for i, il in enumerate(cache.layout.layer_ids) for rows in (cache.k[i], cache.v[i])]


def cuda_bytes(tensors) -> int:
    """Bytes of the distinct tensors on a CUDA device (a tied output on the CPU is the embedding itself)."""
    unique = {id(t): t for t in tensors if t.device.type == "cuda"}
    return sum(t.numel() * t.element_size() for t in unique.values())


# ---- logits: offloaded == all-CPU ------------------------------------------------------------------------
@pytest.mark.parametrize("ngl", ["half", "all"])
def test_offloaded_logits_match_the_all_cpu_run(model, ngl):
    reference = run_steps(model)
    n_gpu_layers = half(model) if ngl == "half" else -1
    assert_close_steps(run_steps(model, devices=[GPU], n_gpu_layers=n_gpu_layers), reference)


def test_nkvo_keeps_kv_on_the_cpu_with_weights_on_the_gpu_and_the_same_logits(model):
    reference = run_steps(model)
    ctx = engine.Context(model, n_ctx=256, devices=[GPU], n_gpu_layers=-1, offload_kqv=False)
    assert all(t.device.type == "cpu" for _, t in kv_tensors(ctx))
    assert all(t.is_cuda for il in range(model.config.n_layer) for t in weight_tensors(model)[f"layer {il}"])
    assert GPU not in {d.name for d in ctx.kv_bytes_by_device}
    del ctx
    gc.collect()
    # run_steps makes its own context with the same placement; the weights stay where they are
    assert_close_steps(run_steps(model, devices=[GPU], n_gpu_layers=-1, offload_kqv=False), reference)


# ---- where tensors live ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ngl", ["half", "all"])
def test_weights_and_kv_live_on_the_device_the_plan_names(model, ngl):
    n_gpu_layers = half(model) if ngl == "half" else -1
    ctx = engine.Context(model, n_ctx=256, devices=[GPU], n_gpu_layers=n_gpu_layers)
    p = ctx.placement
    assert any(d.name == GPU for d in p.layer_devices)
    if ngl == "half":
        assert p.layer_devices[0].name == "CPU"  # a real split, not everything on one device
    weights = weight_tensors(model)
    for il, dev in enumerate(p.layer_devices):
        assert dev.name in ("CPU", GPU)
        assert {t.device.type for t in weights[f"layer {il}"]} == {"cuda" if dev.name == GPU else "cpu"}, il
    assert p.output_device.name == GPU and all(t.is_cuda for t in weights["output"])
    assert not weights["input"][0].is_cuda  # the input embedding always stays on the CPU (llama.cpp)
    for il, t in kv_tensors(ctx):
        assert t.device.type == ("cuda" if p.kv_devices[il].name == GPU else "cpu"), il
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0)) == 0, ctx.last_error
    del ctx
    gc.collect()
    # the last context gone, the weights are back on the CPU
    assert not any(t.is_cuda for ts in weight_tensors(model).values() for t in ts)


# ---- activation traffic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ngl", [0, 1, "half", -1])
def test_bytes_moved_per_token_follow_the_plan(model, ngl):
    n_gpu_layers = half(model) if ngl == "half" else ngl
    ctx = engine.Context(model, n_ctx=256, devices=[GPU], n_gpu_layers=n_gpu_layers)
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0)) == 0, ctx.last_error
    assert ctx.decode(Batch.for_sequence([3], seq_id=0, start_pos=len(PROMPT))) == 0, ctx.last_error
    expected = (expected_bytes_moved(model, ctx.placement, len(PROMPT), 1)
                + expected_bytes_moved(model, ctx.placement, 1, 1))
    assert (expected > 0) == (ngl != 0)
    assert ctx.perf.bytes_moved == expected
    assert ctx.perf.n_tokens_computed == len(PROMPT) + 1
    assert ctx.perf.bytes_moved_per_token == expected / (len(PROMPT) + 1)
    # real copies take time, and none is counted where nothing crosses
    assert (ctx.perf.copy_ms > 0) == (expected > 0)


# ---- memory: refused against the driver's free memory, estimate == allocation ----------------------------
def test_kv_that_does_not_fit_the_free_gpu_memory_is_refused_before_anything_is_allocated():
    # Wide K/V rows (32 heads x 128, f32): 64 KiB per cell over 2 layers, so a few GiB need few cells.
    model = in_memory_model(n_layer=2, n_head=32, n_head_kv=32, head_dim=128)
    probe = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
    per_cell = sum(probe.kv_bytes_by_device.values()) // probe.n_ctx
    del probe
    gc.collect()
    free, total = torch.cuda.mem_get_info()
    # Leave 1 GiB free and ask for 2 GiB of KV: well under the GPU's capacity, over what is free now,
    # so a check against capacity (or none, leaving torch to fail part-way) does not pass.
    blocker = torch.empty(max(0, free - (1 << 30)), dtype=torch.uint8, device="cuda")
    try:
        free_now = torch.cuda.mem_get_info()[0]
        n_ctx = (2 * free_now // per_cell // 256 + 1) * 256
        kv_need = n_ctx * per_cell
        assert free_now < kv_need < total
        # every weight but the input embedding goes to the GPU
        weights = sum(t.numel() * t.element_size() for owner, ts in weight_tensors(model).items()
                      if owner != "input" for t in ts)
        allocated = torch.cuda.memory_allocated()
        with pytest.raises(KvscopeError) as info:
            engine.Context(model, n_ctx=n_ctx, devices=[GPU], n_gpu_layers=-1, type_k="f32", type_v="f32")
        gc.collect()
        assert torch.cuda.memory_allocated() == allocated  # neither weights nor K/V went to the GPU
        assert not any(t.is_cuda for ts in weight_tensors(model).values() for t in ts)
        message = str(info.value)
        numbers = [int(n) for n in re.findall(r"\d+", message)]
        assert GPU in message, message
        assert kv_need in numbers or kv_need + weights in numbers, (kv_need, weights, message)
        # the free figure is the driver's, read at the check (other processes may move it a little)
        assert any(abs(n - free_now) <= 64 << 20 for n in numbers), (free_now, message)
    finally:
        del blocker
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch, ngl", [("llama", 2), ("llama", -1), ("gemma3", 4), ("gemma3", -1)])
def test_estimate_equals_the_cuda_allocation(request, arch, ngl):
    path = request.getfixturevalue(f"tiny_{arch}_hf")
    settings = dict(n_ctx=256, devices=[GPU], n_gpu_layers=ngl)
    est = {row.device: row for row in estimate(path, **settings).devices}
    model = engine.load_model(path)
    ctx = engine.Context(model, **settings)
    kv = kv_tensors(ctx)
    assert cuda_bytes(t for _, t in kv) > 0
    assert est[GPU].kv_bytes == cuda_bytes(t for _, t in kv)
    assert est["CPU"].kv_bytes == sum(t.numel() * t.element_size() for _, t in kv if t.device.type == "cpu")
    assert est[GPU].model_bytes == cuda_bytes(t for ts in weight_tensors(model).values() for t in ts)
    assert not est[GPU].virtual and est[GPU].capacity == torch.cuda.get_device_properties(0).total_memory


# ---- cache operations and state on the GPU ----------------------------------------------------------------
def shifted_then_decoded(model, **settings) -> torch.Tensor:
    """Prefill, shift the sequence by -3 (a K-shift of the keys on their device), decode one token."""
    ctx = engine.Context(model, n_ctx=256, type_k="q8_0", **settings)
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0)) == 0, ctx.last_error
    ctx.memory.seq_rm(0, 0, 3)
    ctx.memory.seq_add(0, 3, -1, -3)
    assert ctx.decode(Batch.for_sequence([9], seq_id=0, start_pos=len(PROMPT) - 3)) == 0, ctx.last_error
    out = ctx.logits(-1).clone()
    del ctx
    gc.collect()
    return out


def test_k_shift_of_quantized_keys_on_the_gpu_matches_the_cpu():
    model = in_memory_model(n_layer=4, head_dim=32, n_embd=64, n_head=2, n_head_kv=1)
    reference = shifted_then_decoded(model)
    assert_close_steps([shifted_then_decoded(model, devices=[GPU], n_gpu_layers=-1)], [reference])


def test_a_sequence_saved_on_the_gpu_restores_on_the_cpu(model):
    ctx = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32", devices=[GPU], n_gpu_layers=-1)
    assert ctx.decode(Batch.for_sequence(PROMPT, seq_id=0, start_pos=0)) == 0, ctx.last_error
    data = ctx.state_seq_get_data(0)
    assert ctx.decode(Batch.for_sequence([5], seq_id=0, start_pos=len(PROMPT))) == 0, ctx.last_error
    on_gpu = ctx.logits(-1).clone()
    del ctx
    gc.collect()
    cpu = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
    assert cpu.state_seq_set_data(data, 0) == len(data)
    assert cpu.decode(Batch.for_sequence([5], seq_id=0, start_pos=len(PROMPT))) == 0, cpu.last_error
    assert_close_steps([cpu.logits(-1)], [on_gpu])


def test_mlp_weights_kept_on_the_cpu_by_ot(model):
    reference = run_steps(model)
    ctx = engine.Context(model, n_ctx=256, devices=[GPU], n_gpu_layers=-1, tensor_overrides=["ffn_.*=CPU"])
    layer = model.transformer.layers[1]
    assert not layer.w_gate_up.is_cuda and not layer.w_down.is_cuda and layer.wqkv.is_cuda
    del ctx
    gc.collect()
    assert_close_steps(run_steps(model, devices=[GPU], n_gpu_layers=-1, tensor_overrides=["ffn_.*=CPU"]), reference)


def test_breakdown_reads_the_driver_and_the_kv_is_allocated_there():
    model = in_memory_model(n_layer=4)
    before = torch.cuda.memory_allocated()
    ctx = engine.Context(model, n_ctx=1024, type_k="f32", type_v="f32", devices=[GPU], n_gpu_layers=-1)
    gpu = ctx.gpus[0]
    row = ctx.memory_breakdown()[gpu]
    assert torch.cuda.memory_allocated() - before >= row.model + row.context
    line = ctx.memory_breakdown_lines()[1]
    total, free = map(int, re.findall(r"\| +(\d+) = +(\d+) \+", line)[0])
    assert total == torch.cuda.mem_get_info()[1] // (1 << 20)
    assert abs(free - torch.cuda.mem_get_info()[0] // (1 << 20)) <= 64


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q8_0"])
def test_packed_weights_offloaded_to_cuda(tmp_path, tensor_type):
    """Packed quantized weights (engine/models/packed.py) re-packed for CUDA by -ngl: the GPU holds the
    offloaded layers' packed bytes (not f32 ones), and the logits stay within the packing's error of
    the CPU's packed logits (int4: bf16 activations on both; int8: f32 activations on CUDA)."""
    from engine.models.packed import PackedWeight
    from engine.testing import write_gguf_from_hf, write_hf_model

    folder = write_hf_model(tmp_path / "m", "llama", seed=2, n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
                            n_ff=512, vocab_size=512)
    path = write_gguf_from_hf(folder, tmp_path / "m.gguf", tensor_type=tensor_type)
    tokens = list(range(3, 35))
    cpu_model = engine.load_model(path)
    ctx = engine.Context(cpu_model, n_ctx=64, pad=32, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)) == 0
    ref = ctx.all_logits().clone()
    del ctx
    model = engine.load_model(path)
    ctx = engine.Context(model, n_ctx=64, pad=32, type_k="f32", type_v="f32", n_gpu_layers=-1)
    layer = model.transformer.layers[0]
    assert isinstance(layer.wqkv, PackedWeight) and layer.wqkv.device.type == "cuda"
    gpu = next(d for d in ctx.model_bytes_by_device if d.name == GPU)
    assert ctx.model_bytes_by_device[gpu] == estimate(path, n_ctx=64, pad=32, type_k="f32", type_v="f32",
                                                      n_gpu_layers=-1).devices[1].model_bytes
    assert ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)) == 0
    got = ctx.all_logits().cpu()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 0.03, f"CUDA packed logits {rel:.2%} of the largest logit away from the CPU's"
