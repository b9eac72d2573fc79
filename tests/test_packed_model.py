"""Quantized GGUF models whose matrices stay packed (engine/models/packed.py): logits close to the
file's exact values, resident bytes close to the file's, and every byte count (the context's, the
estimate's, per device) the packed one."""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

import engine
from engine.batch import Batch
from engine.formats.gguf_file import open_gguf
from engine.models.packed import PackedRows, PackedWeight
from engine.sizing.estimate import estimate, fit
from engine.testing import write_gguf_from_hf, write_hf_model

# K-quants need rows of 256 values: the smallest llama that every type can store
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=512)
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("hf") / "packed-llama", "llama", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def gguf_of(llama_folder, tmp_path_factory):
    made: dict[str, Path] = {}

    def make(tensor_type: str) -> Path:
        if tensor_type not in made:
            made[tensor_type] = write_gguf_from_hf(llama_folder, tmp_path_factory.mktemp("gguf") / f"{tensor_type}.gguf",
                                                   tensor_type=tensor_type)
        return made[tensor_type]

    return make


def all_logits(model, tokens: list[int]) -> torch.Tensor:
    ctx = engine.Context(model, n_ctx=64, pad=32, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(tokens, 0, 0, all_logits=True)) == 0
    return ctx.all_logits()


def file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in open_gguf(path).tensors)


@pytest.mark.parametrize("tensor_type", TYPES)
def test_packed_logits_stay_close_to_the_files_values(gguf_of, tensor_type):
    """Against the same file decoded exactly: int4 differs only by bf16 scales and activations, int8 by
    the per-row re-quantization of Q8_0/Q6_K (measured on bench/decode.py's model: 0.9-1.1% of the
    largest logit for int4, 3.2-3.4% for int8; llama.cpp's own quantized dot products move it 2-3%)."""
    path = gguf_of(tensor_type)
    packed, exact = engine.load_model(path), engine.load_model(path, keep_quantized=False)
    assert packed.kept_quantized and not exact.kept_quantized
    layer = packed.transformer.layers[0]
    assert all(isinstance(w, PackedWeight) for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
    assert isinstance(packed.transformer.tok_embd, PackedRows)
    tokens = torch.randint(3, packed.n_vocab, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, ref = all_logits(packed, tokens), all_logits(exact, tokens)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    bound = 0.02 if tensor_type in ("Q4_0", "Q4_K") else 0.06
    assert rel < bound, f"{tensor_type}: max |packed - exact| is {rel:.2%} of the largest logit"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # a wrong Q/K row order or embedding row would be far off, not a few percent
    assert 0 < rel


@pytest.mark.parametrize("tensor_type, ratio", [("Q8_0", 1.0), ("Q4_0", 1.15), ("Q4_K", 1.15), ("Q6_K", 1.25)])
def test_resident_weight_bytes_close_to_the_files(gguf_of, tensor_type, ratio):
    """Q4_0/Q4_K: 5 bits per weight against the file's 4.5; Q8_0: 8 against 8.5; Q6_K: 8 against 6.56
    (torch has no 6-bit or group-wise int8 kernel). F32 norms count on both sides."""
    path = gguf_of(tensor_type)
    model = engine.load_model(path)
    held, in_file = model.transformer.resident_weight_bytes(), file_tensor_bytes(path)
    assert held <= ratio * in_file, f"{tensor_type}: {held} bytes held for {in_file} in the file"
    exact = engine.load_model(path, keep_quantized=False).transformer.resident_weight_bytes()
    assert held < exact / 2.5  # f32 would be 3.8-7x the file


PLACEMENTS = {
    "cpu": dict(n_ctx=128),
    "partial_gpu": dict(n_ctx=128, n_gpu_layers=2, devices=["VGPU0=256MiB"]),  # layer 1 and the output
    "all_gpu_ffn_on_cpu": dict(n_ctx=128, n_gpu_layers=-1, devices=["VGPU0=256MiB"],
                               tensor_overrides=[r"blk\.1\.ffn_.*=CPU"]),
}


@pytest.mark.parametrize("tensor_type", ["Q4_K", "mixed"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_estimate_counts_packed_bytes_per_device(gguf_of, tensor_type, placement):
    """`kvscope estimate` reads the storage types from the header and predicts the context's packed
    weight bytes on each device to the byte, -ngl and -ot included ("mixed": float and packed fused
    matrices side by side)."""
    path, settings = gguf_of(tensor_type), PLACEMENTS[placement]
    est = estimate(path, **settings)
    model = engine.load_model(path)
    ctx = engine.Context(model, **settings)
    try:
        predicted = {d.device: d.model_bytes for d in est.devices if d.model_bytes}
        assert predicted == {d.name: n for d, n in ctx.model_bytes_by_device.items() if n}
        if "devices" in settings:
            gpu = next(d for d in ctx.model_bytes_by_device if d.name == "VGPU0")
            on_gpu = sum(t.nbytes for il, layer in enumerate(model.transformer.layers)
                         for name, t in vars(layer).items() if isinstance(t, PackedWeight)
                         and model.transformer.weight_devices.layers[il].fields[name].name == gpu.name)
            assert 0 < on_gpu <= ctx.model_bytes_by_device[gpu]
    finally:
        del ctx, model
        gc.collect()
    # decoding the file instead is counted as such
    assert estimate(path, keep_quantized=False, **settings).devices[0].model_bytes >= est.devices[0].model_bytes


def test_tied_quantized_embedding_keeps_blocks_and_a_packed_output(tmp_path):
    """A tied embedding stored Q8_0: lookups read its blocks, the output layer multiplies by a packed copy;
    both are counted, here and in the estimate, and the logits stay close to the exact ones."""
    folder = write_hf_model(tmp_path / "tied", "gemma3", seed=5, n_layer=2, n_embd=256, n_head=2, n_head_kv=1,
                            n_ff=512, vocab_size=512)
    path = write_gguf_from_hf(folder, tmp_path / "tied.gguf", tensor_type="Q8_0")
    model = engine.load_model(path)
    tf = model.transformer
    assert isinstance(tf.tok_embd, PackedRows) and isinstance(tf.output_embd, PackedWeight)
    assert model.transformer.resident_weight_bytes() == tf.tok_embd.nbytes + tf.output_embd.nbytes + sum(
        n for name, n in _layer_and_norm_bytes(tf))
    for settings in (dict(n_ctx=128), dict(n_ctx=128, n_gpu_layers=-1, devices=["VGPU0=256MiB"])):
        est = estimate(path, **settings)
        ctx = engine.Context(model, **settings)
        assert {d.device: d.model_bytes for d in est.devices if d.model_bytes} == {
            d.name: n for d, n in ctx.model_bytes_by_device.items() if n}
        del ctx
        gc.collect()
    tokens = list(range(3, 27))
    ours, ref = all_logits(model, tokens), all_logits(engine.load_model(path, keep_quantized=False), tokens)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 0.06


def _layer_and_norm_bytes(tf):
    yield "norm", tf.norm.numel() * tf.norm.element_size()
    for il, layer in enumerate(tf.layers):
        for name, t in vars(layer).items():
            if t is not None:
                yield f"{il}.{name}", t.nbytes if isinstance(t, PackedWeight) else t.numel() * t.element_size()


def test_fit_sizes_packed_weights(gguf_of):
    """--fit decides on the packed bytes: a device that holds the packed layers but not f32 ones."""
    path = gguf_of("Q4_0")
    packed = estimate(path, n_ctx=128)
    exact = estimate(path, n_ctx=128, keep_quantized=False)
    packed_w, exact_w = packed.devices[0].model_bytes, exact.devices[0].model_bytes
    assert packed_w * 4 < exact_w
    everything = estimate(path, n_ctx=256, n_gpu_layers=-1, devices=["VGPU0=1GiB"]).devices[1]
    capacity = everything.total_bytes  # the packed model, all of it; the f32 one's layers do not fit
    chosen = fit(path, n_ctx=256, devices=[f"VGPU0={capacity}B"])
    refused = fit(path, n_ctx=256, devices=[f"VGPU0={capacity}B"], keep_quantized=False)
    assert chosen.placement.n_gpu_layers == SHAPE["n_layer"] + 1 > refused.placement.n_gpu_layers


def test_gguf_reader_blocks_are_not_decoded(gguf_of):
    """Loading packed never builds a float32 matrix of a quantized weight: the largest float tensor the
    transformer holds is a norm."""
    model = engine.load_model(gguf_of("Q4_0"))
    tf = model.transformer
    floats = [t for layer in tf.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)] + [tf.norm]
    assert max(t.numel() for t in floats) == SHAPE["n_embd"]
    assert np.isfinite(all_logits(model, [5, 6, 7]).numpy()).all()
