"""Float weights in row blocks (engine.models.transformer.row_blocks): every number of input rows, on
either side of the switch between per-block products and one GEMM, none included, gives x @ W.T (+ b),
for matrices split into blocks and for those kept whole."""
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models.transformer import MIN_SPLIT_ELEMENTS, SPLIT_MAX_TOKENS, as_row_blocks, project, row_blocks


@pytest.mark.parametrize("n_rows", [0, 1, 2, 7, SPLIT_MAX_TOKENS, SPLIT_MAX_TOKENS + 1])
@pytest.mark.parametrize("n_split", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_projection_in_row_blocks_equals_linear(n_rows, n_split, with_bias):
    gen = torch.Generator().manual_seed(n_rows * 10 + n_split)
    n_out, n_in = 6 * 128, MIN_SPLIT_ELEMENTS // (6 * 128) + 8  # large enough to be split
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if with_bias else None
    x = torch.randn(n_rows, n_in, generator=gen)
    blocks = row_blocks(w, torch.float32, n_split)
    assert blocks.shape == (n_split, n_out // n_split, n_in)
    assert blocks.data_ptr() == w.data_ptr()  # a view of the file's [out, in] matrix, not a copy
    got = project(x, blocks, b)
    assert got.shape == (n_rows, n_out) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_or_indivisible_matrices_stay_whole():
    rows = MIN_SPLIT_ELEMENTS // 64  # an even number of 64-wide rows: exactly the threshold
    assert as_row_blocks(torch.zeros(rows, 64), 2).shape == (2, rows // 2, 64)
    assert as_row_blocks(torch.zeros(rows - 2, 64), 2).shape == (1, rows - 2, 64)  # below the threshold
    assert as_row_blocks(torch.zeros(rows + 1, 64), 2).shape == (1, rows + 1, 64)  # rows do not divide
    assert as_row_blocks(torch.zeros(rows, 64), 1).shape == (1, rows, 64)  # one thread: one block


def test_decode_and_prefill_of_a_model_agree_with_a_gemm_reference():
    """A model whose matrices are split: the logits of one decoded token equal those of the same token
    at the end of a prompt (computed by one GEMM per matrix), to float32 rounding."""
    import engine
    from engine.batch import Batch
    from engine.testing import write_gguf_from_hf, write_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        hf = write_hf_model(Path(tmp) / "m", "llama", n_layer=2, n_embd=512, n_head=8, n_head_kv=2, n_ff=1024,
                            vocab_size=1024, seed=3)
        model = engine.load_model(write_gguf_from_hf(hf, Path(tmp) / "m.gguf"))
    assert model.transformer.layers[0].w_gate_up.shape[0] == max(1, torch.get_num_threads())
    prompt = list(range(5, 5 + SPLIT_MAX_TOKENS + 3))
    whole = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
    assert whole.decode(Batch.for_sequence(prompt, 0, 0)) == 0  # > SPLIT_MAX_TOKENS rows: GEMMs
    stepped = engine.Context(model, n_ctx=256, type_k="f32", type_v="f32")
    assert stepped.decode(Batch.for_sequence(prompt[:-1], 0, 0)) == 0
    assert stepped.decode(Batch.for_sequence(prompt[-1:], 0, len(prompt) - 1)) == 0  # one row: per block
    torch.testing.assert_close(stepped.logits(-1), whole.logits(-1), rtol=1e-4, atol=1e-4)


def test_training_reaches_every_weight_through_the_row_blocks(tmp_path):
    """tools/train_demo_model.py builds a Transformer from leaf tensors and backpropagates through
    forward_train: every weight gets its gradient through the row blocks (split ones included, in the
    per-block products of a few rows), and the whole-sequence forward agrees with the cache's."""
    import engine
    from engine.batch import Batch
    from engine.models.full_sequence import FullSequenceAttention
    from engine.models.load import read_checkpoint
    from engine.models.transformer import Transformer
    from engine.testing import write_hf_model

    hf = write_hf_model(tmp_path / "m", "llama", n_layer=1, n_embd=512, n_head=8, n_head_kv=2, n_ff=1024,
                        vocab_size=600, seed=4)
    ckpt = read_checkpoint(hf)
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in ckpt.tensors.items()}
    model = Transformer(ckpt.config, leaves, torch.float32)
    assert model.layers[0].wo.shape[0] == max(1, torch.get_num_threads())  # 512 x 512: split when threads allow
    tokens = torch.tensor([[5, 9, 17, 3, 40, 2, 11, 8], [7, 7, 30, 1, 12, 90, 4, 6]])
    attn = FullSequenceAttention(ckpt.config, n_groups=2, n_tokens=8)
    logits = model.forward_train(tokens.reshape(-1), attn.positions(), attn, torch.arange(16))
    F.cross_entropy(logits[:-1], tokens.reshape(-1)[1:]).backward()
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.abs().sum() > 0, name
    ctx = engine.Context(engine.load_model(hf), n_ctx=64, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(tokens[1].tolist(), 0, 0)) == 0
    torch.testing.assert_close(ctx.logits(-1), logits[-1].detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e3])
def test_one_row_rms_norm_equals_the_rows_norm(scale):
    """Decode's one-row RMSNorm (inference mode: mean(x^2) + eps as one addmm) gives what the norm of
    many rows gives for the same row, over small and large activations, and eps counts as it should;
    outside inference mode (training) a row takes the general path, with the same result."""
    from engine.models.transformer import rms_norm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 768, generator=gen) * scale
    w = torch.randn(768, generator=gen)
    many = rms_norm(x, w, 1e-5)
    ref = x[:1] * torch.rsqrt(x[:1].double().pow(2).mean() + 1e-5).float() * w
    tiny = torch.full((1, 768), 1e-4)  # mean(x^2) = 1e-8, far under eps: eps dominates
    for inference in (True, False):
        with torch.inference_mode(inference):
            for i in range(5):
                torch.testing.assert_close(rms_norm(x[i:i + 1], w, 1e-5), many[i:i + 1], rtol=2e-6, atol=0)
            torch.testing.assert_close(rms_norm(x[:1], w, 1e-5), ref, rtol=2e-6, atol=0)
            torch.testing.assert_close(rms_norm(tiny, torch.ones(768), 1e-5), tiny / (1e-8 + 1e-5) ** 0.5,
                                       rtol=1e-6, atol=0)
            torch.testing.assert_close(rms_norm(tiny, torch.ones(768), 1e-3), tiny / (1e-8 + 1e-3) ** 0.5,
                                       rtol=1e-6, atol=0)  # another eps: its own table
