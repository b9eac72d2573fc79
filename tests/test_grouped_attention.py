"""The grouped-query attention path (query heads stacked per KV head for few tokens per stream) gives
what torch's own GQA gives, for every number of tokens per stream on either side of the switch."""
import pytest
import torch
import torch.nn.functional as F

from engine.models.transformer import GROUPED_MAX_TOKENS, grouped_query_attention, single_query_attention


@pytest.mark.parametrize("n_tokens", [1, 3, GROUPED_MAX_TOKENS, GROUPED_MAX_TOKENS + 1])
@pytest.mark.parametrize("n_head, n_head_kv", [(12, 4), (4, 4), (8, 1)])
def test_grouped_attention_equals_repeated_kv(n_tokens, n_head, n_head_kv):
    gen = torch.Generator().manual_seed(n_tokens * 100 + n_head + n_head_kv)
    G, D, n_kv = 2, 16, 40
    q = torch.randn(G, n_tokens, n_head, D, generator=gen).transpose(1, 2)  # strided, as the model has it
    rows_k = torch.randn(G, n_kv, n_head_kv * D, generator=gen)
    rows_v = torch.randn(G, n_kv, n_head_kv * D, generator=gen)
    keys = rows_k.view(G, n_kv, n_head_kv, D).transpose(1, 2)  # cache rows read in place
    values = rows_v.view(G, n_kv, n_head_kv, D).transpose(1, 2)
    mask = torch.rand(G, 1, n_tokens, n_kv, generator=gen) > 0.4
    mask[..., 0] = True  # every token sees one cell at least
    rep = n_head // n_head_kv
    expected = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                              attn_mask=mask, scale=0.3)
    got = grouped_query_attention(q, keys, values, mask, 0.3)
    assert got.shape == (G, n_head, n_tokens, D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a token's output depends on its own mask row only: changing another token's row leaves it alone
    if n_tokens > 1:
        mask2 = mask.clone()
        mask2[:, :, 1:, 1:] = ~mask2[:, :, 1:, 1:]
        got2 = grouped_query_attention(q, keys, values, mask2, 0.3)
        torch.testing.assert_close(got2[:, :, 0], got[:, :, 0])
        assert not torch.allclose(got2[:, :, 1:], got[:, :, 1:])


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("n_head, n_head_kv", [(12, 4), (4, 4), (8, 1)])
def test_single_query_attention_equals_the_grouped_path(with_mask, n_head, n_head_kv):
    """A decode step's one token: the view that stacks its query heads per KV head gives what the
    general grouped path gives, with a mask (other sequences' cells hidden) and without one."""
    gen = torch.Generator().manual_seed(n_head * 10 + n_head_kv + with_mask)
    D, n_kv = 16, 40
    q = torch.randn(1, n_head, D, generator=gen)  # [T = 1, H, D], as RoPE leaves it
    rows = torch.randn(2, 1, n_kv, n_head_kv * D, generator=gen)
    keys, values = (r.view(1, n_kv, n_head_kv, D).transpose(1, 2) for r in rows)
    mask = None
    if with_mask:
        mask = torch.rand(1, 1, 1, n_kv, generator=gen) > 0.5
        mask[..., 0] = True
    got = single_query_attention(q, keys, values, mask, 0.3)
    expected = grouped_query_attention(q.view(1, 1, n_head, D).transpose(1, 2), keys, values, mask, 0.3)
    assert got.shape == (1, n_head * D)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(1, n_head * D), rtol=1e-6, atol=1e-6)
    if with_mask:  # the mask is applied: uncovering the hidden cells changes the result
        assert not torch.allclose(got, single_query_attention(q, keys, values, None, 0.3))


@pytest.mark.parametrize("ctype, transposed", [("f32", False), ("f16", False), ("f16", True), ("q8_0", False)])
def test_a_run_of_cells_is_written_as_the_same_cells_by_index(ctype, transposed):
    """Rows written to a run of cells of one stream (a slice: decode's usual case) land exactly where
    the same cells written by index tensors land, in every storage layout."""
    from engine.kv.storage import RowStorage
    from engine.kv.types import cache_type

    def storage():
        return RowStorage(cache_type(ctype), n_stream=2, kv_size=64, width=64, n_head=4, transposed=transposed)

    by_index, by_run = storage(), storage()
    for n in (1, 5):  # one token (decode) and a short prompt
        rows = torch.randn(n, 64)
        cells = torch.arange(20, 20 + n)
        by_index.write(torch.ones(n, dtype=torch.long), cells, rows)
        by_run.write(1, slice(20, 20 + n), rows)
        assert torch.equal(by_run.data, by_index.data)
        assert by_run.data[1].any() and not by_run.data[0].any()  # the other stream is untouched
        torch.testing.assert_close(by_run.read_cells(1, cells), by_index.read_cells(1, cells))


def test_decode_writes_its_cells_as_a_run_and_scattered_cells_by_index(monkeypatch):
    """A prompt in an empty cache and a decode step write slices; tokens whose cells are not
    consecutive (the slot search restarts at cell 0 and fills holes) go by index tensors, and their
    K rows land in exactly those cells."""
    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    records = _recorded_attention(monkeypatch)
    ctx = engine.Context(in_memory_model(), n_ctx=512, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(list(range(1, 41)), 0, 0)) == 0
    assert records[-1]._write_at == (0, slice(0, 40))
    assert ctx.decode(Batch.for_sequence([3], 0, 40)) == 0
    assert records[-1]._write_at == (0, slice(40, 41))
    ctx.memory.seq_rm(0, 30, -1)
    ctx.memory.seq_rm(0, 5, 7)  # holes at cells 5 and 6; few cells used, so the search starts at 0
    k_rows = ctx.memory.k[0]
    before = k_rows.read_cells(0, torch.arange(64))
    assert ctx.decode(Batch.for_sequence([7, 8, 9], 0, 30)) == 0
    streams, cells = records[-1]._write_at
    assert cells.tolist() == [5, 6, 30] and streams.tolist() == [0, 0, 0]
    after = k_rows.read_cells(0, torch.arange(64))
    changed = (after != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5, 6, 30]


# ---- what the kernel reads: the cells up to the last visible one, and no mask when all are visible --------

def _recorded_attention(monkeypatch):
    from engine.kv.attention import UbatchAttention

    records = []
    build = UbatchAttention.__init__

    def recording_init(self, cache, sinfo, ubatch):
        build(self, cache, sinfo, ubatch)
        records.append(self)

    monkeypatch.setattr(UbatchAttention, "__init__", recording_init)
    return records


def test_one_sequence_decoding_reads_its_cells_and_passes_no_mask(monkeypatch):
    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    records = _recorded_attention(monkeypatch)
    ctx = engine.Context(in_memory_model(), n_ctx=512, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(list(range(1, 41)), 0, 0)) == 0
    assert ctx.decode(Batch.for_sequence([7], 0, 40)) == 0
    step = records[-1]
    assert step.n_kv == 256 and step.n_visible == 41  # llama.cpp's padded n_kv; the kernel reads 41 cells
    assert step.attend_mask is None and bool(step.mask[..., :41].all()) and not bool(step.mask[..., 41:].any())
    prompt = records[-2]  # causal: token t sees cells 0..t, so a mask is needed
    assert prompt.n_visible == 40 and prompt.attend_mask is not None
    assert torch.equal(prompt.attend_mask, prompt.mask[..., :40])


def test_trimmed_attention_gives_the_full_masks_logits(monkeypatch):
    """Two sequences in one stream with a hole: logits with the trimmed, mask-free kernel inputs equal
    those of the full n_kv-wide mask (the trim switched off by widening n_visible back)."""
    import engine
    from engine.batch import Batch
    from engine.kv.attention import UbatchAttention
    from tests.model_factory import in_memory_model

    model = in_memory_model()

    def run():
        ctx = engine.Context(model, n_ctx=512, n_seq_max=2, kv_unified=True, type_k="f32", type_v="f32")
        assert ctx.decode(Batch.for_sequence(list(range(1, 30)), 0, 0)) == 0
        assert ctx.decode(Batch.for_sequence(list(range(5, 20)), 1, 0)) == 0
        ctx.memory.seq_rm(0, 10, 20)
        out = []
        for i, (seq, pos) in enumerate([(0, 29), (1, 15), (0, 30)]):
            assert ctx.decode(Batch.for_sequence([3 + i], seq, pos)) == 0
            out.append(ctx.logits(-1).clone())
        return torch.stack(out)

    trimmed = run()
    build = UbatchAttention.__init__

    def untrimmed(self, cache, sinfo, ubatch):
        build(self, cache, sinfo, ubatch)
        self.n_visible = self.n_kv
        self.attend_mask = self.mask
        self._mask_on = {torch.device("cpu"): self.mask}

    monkeypatch.setattr(UbatchAttention, "__init__", untrimmed)
    full = run()
    torch.testing.assert_close(trimmed, full, rtol=1e-5, atol=1e-5)


def test_f16_rows_are_converted_into_reused_memory():
    """f16 K/V read for attention land in one buffer per cache, reused layer after layer and step after
    step (fresh f32 copies cost more in page faults than the attention at 32k cells), grown by half
    again when a read needs more, never beyond the storage's own element count."""
    from engine.kv.storage import RowStorage, Scratch
    from engine.kv.types import cache_type

    rows = RowStorage(cache_type("f16"), n_stream=1, kv_size=64, width=32, n_head=2)
    values = torch.randn(40, 32)
    rows.write(torch.zeros(40, dtype=torch.long), torch.arange(40), values)
    scratch = Scratch()
    first = rows.read_heads(slice(0, 1), 20, torch.float32, scratch)
    torch.testing.assert_close(first, rows.read_heads(slice(0, 1), 20, torch.float32))  # same values as .to()
    assert first.dtype == torch.float32 and first.shape == (1, 2, 20, 16)
    torch.testing.assert_close(first[0].transpose(0, 1).reshape(20, 32), values[:20].half().float())
    held = scratch.nbytes
    assert held == 30 * 32 * 4  # 20 cells and half again
    again = rows.read_heads(slice(0, 1), 21, torch.float32, scratch)  # one more cell: no new memory
    assert scratch.nbytes == held and again.data_ptr() == first.data_ptr()
    rows.read_heads(slice(0, 1), 60, torch.float32, scratch)  # grows, capped at the storage's 64 cells
    assert scratch.nbytes == 64 * 32 * 4
    same_type = rows.read_heads(slice(0, 1), 20, torch.float16, scratch)  # no conversion: a view
    assert same_type.data_ptr() == rows.data.data_ptr()


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
@pytest.mark.parametrize("n_head,head_dim", [(2, 32), (4, 64), (2, 48)])  # 48: blocks straddle two heads
def test_quantized_rows_are_decoded_in_pieces_into_reused_memory(name, n_head, head_dim, monkeypatch):
    """A quantized cache's rows read for attention equal the whole-read decode, also when the read spans
    several decode pieces, and land in the scratch buffer; for every type, and heads whose values span
    parts of two blocks."""
    from engine.kv import storage
    from engine.kv.storage import RowStorage, Scratch
    from engine.kv.types import cache_type

    monkeypatch.setattr(storage, "DEQUANT_CELLS", 16)  # 50 cells: four pieces, the last one short
    width = n_head * head_dim
    rows = RowStorage(cache_type(name), n_stream=2, kv_size=64, width=width, n_head=n_head)
    rows.write(torch.tensor([1] * 50), torch.arange(50), torch.randn(50, width))
    scratch = Scratch()
    got = rows.read_heads(slice(1, 2), 50, torch.float32, scratch)
    expected = rows.read(slice(1, 2), 50, torch.float32).view(1, 50, n_head, head_dim).transpose(1, 2)
    assert got.shape == (1, n_head, 50, head_dim)
    assert torch.equal(got, expected)
    assert scratch.nbytes == 75 * width * 4  # the 50 cells read and half again (under the storage's 128)


@pytest.mark.parametrize("name", ["q8_0", "q4_1"])
def test_quantized_rows_of_several_streams_decode_per_stream(name):
    """Streams picked by an index tensor (a ubatch over several streams) decode each stream's own rows; a
    compute dtype other than float32 gets the float32 decode's values rounded once."""
    from engine.kv.storage import RowStorage, Scratch
    from engine.kv.types import cache_type

    rows = RowStorage(cache_type(name), n_stream=3, kv_size=32, width=64, n_head=2)
    values = torch.randn(3, 20, 64)
    for s in range(3):
        rows.write(torch.full((20,), s), torch.arange(20), values[s])
    streams = torch.tensor([2, 0])
    got = rows.read_heads(streams, 20, torch.float32, Scratch())
    for g, s in enumerate((2, 0)):
        alone = rows.read(slice(s, s + 1), 20, torch.float32)[0]
        assert torch.equal(got[g].transpose(0, 1).reshape(20, 64), alone)
    in_bf16 = rows.read_heads(streams, 20, torch.bfloat16, Scratch())
    assert in_bf16.dtype == torch.bfloat16 and torch.equal(in_bf16, got.to(torch.bfloat16))


def test_transposed_f16_v_is_converted_into_reused_memory_too():
    """V stored transposed (flash attention off) reads as the same heads, converted into the scratch."""
    from engine.kv.storage import RowStorage, Scratch
    from engine.kv.types import cache_type

    rows = RowStorage(cache_type("f16"), n_stream=1, kv_size=64, width=32, n_head=2, transposed=True)
    values = torch.randn(40, 32)
    rows.write(torch.zeros(40, dtype=torch.long), torch.arange(40), values)
    scratch = Scratch()
    got = rows.read_heads(slice(0, 1), 40, torch.float32, scratch)
    assert got.shape == (1, 2, 40, 16) and scratch.nbytes == 60 * 32 * 4
    torch.testing.assert_close(got[0].transpose(0, 1).reshape(40, 32), values.half().float())
    torch.testing.assert_close(got, rows.read_heads(slice(0, 1), 40, torch.float32))
