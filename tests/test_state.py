"""State save/restore (src/llama-kv-cache.cpp llama_kv_cache::state_write/state_read): byte format,
bit-exact round trips, the placement rules of whole and single-sequence restores, every refusal and
the state it leaves, and watcher mirrors."""
from __future__ import annotations

import struct

import pytest
import torch

from engine import Batch, CacheMirror, Context, EventBus
from engine.errors import ContextParamsError, KvscopeError, MemoryOperationError
from engine.kv import state as st
from engine.kv.state import StateFileError
from tests.model_factory import in_memory_model

N_CTX, PAD = 32, 32  # 32 cells per stream


@pytest.fixture(scope="module")
def model():
    return in_memory_model()


@pytest.fixture(scope="module")
def swa_model():
    return in_memory_model(n_swa=4, swa_type=1, swa_layers=(True, False))


def make_ctx(model, *, n_ctx=N_CTX, n_seq_max=2, kv_unified=True, type_k="f16", type_v=None, flash_attn="auto",
             bus=None) -> Context:
    return Context(model, n_ctx=n_ctx, pad=PAD, n_seq_max=n_seq_max, kv_unified=kv_unified, type_k=type_k,
                   type_v=type_v or type_k, flash_attn=flash_attn, bus=bus)


def decode(ctx: Context, tokens, pos, seqs) -> None:
    rc = ctx.decode(Batch(list(tokens), list(pos), [[s] if isinstance(s, int) else list(s) for s in seqs]))
    assert rc == 0, ctx.last_error


def fill_two_seqs(ctx: Context) -> None:
    """seq 0 at positions 0-2 and seq 1 at 0-1 (split streams: one stream each)."""
    decode(ctx, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [0, 0, 0, 1, 1])


def caches(ctx: Context):
    return st.caches_of(ctx.memory)


def view(ctx: Context):
    """Cells and heads of every stream of every cache."""
    return [(c.name, s, c.cells(s), c.head(s)) for c in caches(ctx) for s in range(c.n_stream)]


def empty_view(ctx: Context):
    return [(c.name, s, [(-1, frozenset(), 0)] * c.size, 0) for c in caches(ctx) for s in range(c.n_stream)]


def tensors(ctx: Context):
    return [t.data.clone() for c in caches(ctx) for t in c.k + c.v]


def kv_rows(cache, stream: int, idxs) -> list[torch.Tensor]:
    """Raw bytes of the K and V of some cells of one stream, per layer."""
    idx = torch.as_tensor(list(idxs), dtype=torch.long)
    out = [k.stored_rows(stream, idx).contiguous().view(torch.uint8) for k in cache.k]
    for v in cache.v:
        data = v.data[stream][:, idx] if v.transposed else v.stored_rows(stream, idx)
        out.append(data.contiguous().view(torch.uint8))
    return out


def assert_same_rows(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def next_logits(ctx: Context, tokens, pos, seqs) -> torch.Tensor:
    decode(ctx, tokens, pos, seqs)
    return ctx.all_logits().clone()


# ---- an independent parser of llama_kv_cache::state_write's format, for format checks -------------
class Parser:
    def __init__(self, data: bytes) -> None:
        self.data, self.off = data, 0

    def take(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.data, self.off)
        self.off += struct.calcsize("<" + fmt)
        return vals if len(vals) > 1 else vals[0]

    def raw(self, n: int) -> bytes:
        out = self.data[self.off:self.off + n]
        assert len(out) == n
        self.off += n
        return out

    def cache(self):
        streams = []
        for _ in range(self.take("I")):
            cell_count = self.take("I")
            if not cell_count:
                streams.append(None)
                continue
            meta = []
            for _ in range(cell_count):
                pos, n = self.take("iI")
                meta.append((pos, [self.take("i") for _ in range(n)]))
            v_trans, n_layer = self.take("II")
            k = []
            for _ in range(n_layer):
                tid, row = self.take("iQ")
                k.append((tid, row, self.raw(row * cell_count)))
            v = []
            for _ in range(n_layer):
                if not v_trans:
                    tid, row = self.take("iQ")
                    v.append((tid, row, self.raw(row * cell_count)))
                else:
                    tid, el, n_embd = self.take("iII")
                    v.append((tid, el, n_embd, self.raw(el * n_embd * cell_count)))
            streams.append({"meta": meta, "v_trans": v_trans, "k": k, "v": v})
        return streams


# ---- format ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_whole_state_layout(model, flash_attn):
    ctx = make_ctx(model, flash_attn=flash_attn)
    decode(ctx, [5, 6, 7], [0, 1, 2], [(0, 1)] * 3)
    decode(ctx, [8], [3], [0])
    data = ctx.state_get_data()
    p = Parser(data)
    assert p.take("I") == 5 and p.raw(5) == b"llama"
    (stream,) = p.cache()
    assert p.off == len(data)
    assert stream["meta"] == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1]), (3, [0])]
    assert stream["v_trans"] == (flash_attn == "off")
    cache = ctx.memory
    for il, (tid, row, rows) in enumerate(stream["k"]):
        assert (tid, row) == (1, 32)  # f16, 16 values
        assert rows == kv_rows(cache, 0, range(4))[il].numpy().tobytes()
    for il, entry in enumerate(stream["v"]):
        if flash_attn == "off":
            assert entry[:3] == (1, 2, 16)  # type, element size, n_embd_v_gqa
            # row j of V holds the elements of the 4 cells, rows one after the other
            expect = cache.v[il].data[0][:, :4].contiguous().view(torch.uint8).numpy().tobytes()
        else:
            assert entry[:2] == (1, 32)
            expect = cache.v[il].stored_rows(0, torch.arange(4)).contiguous().view(torch.uint8).numpy().tobytes()
        assert entry[-1] == expect


def test_seq_state_layout_lists_only_that_seq(model):
    ctx = make_ctx(model, n_seq_max=3)
    decode(ctx, [5, 6, 7], [0, 1, 2], [(0, 1)] * 3)
    decode(ctx, [8, 9], [0, 3], [2, 1])  # cell 3: seq 2, cell 4: seq 1
    data = ctx.state_seq_get_data(1)
    p = Parser(data)
    assert p.take("I") == st.STATE_SEQ_IO_MAGIC and p.take("i") == 1
    (stream,) = p.cache()
    assert p.off == len(data)
    assert stream["meta"] == [(0, [1]), (1, [1]), (2, [1]), (3, [1])]
    # the rows of the maximal ranges [0, 3) and [4, 5), in order
    assert stream["k"][0][2] == kv_rows(ctx.memory, 0, [0, 1, 2, 4])[0].numpy().tobytes()


def test_split_streams_state_lists_empty_streams(model):
    ctx = make_ctx(model, kv_unified=False)
    decode(ctx, [5, 6], [0, 1], [1, 1])
    p = Parser(ctx.state_seq_get_data(1))
    p.take("Ii")
    streams = p.cache()
    assert streams[0] is None and [m[0] for m in streams[1]["meta"]] == [0, 1]


# ---- whole round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("flash_attn", ["auto", "off"])
@pytest.mark.parametrize("type_k", ["f32", "f16", "bf16"])
def test_whole_round_trip_is_bit_exact(model, kv_unified, flash_attn, type_k):
    src = make_ctx(model, kv_unified=kv_unified, flash_attn=flash_attn, type_k=type_k)
    fill_two_seqs(src)
    data = src.state_get_data()
    dst = make_ctx(model, kv_unified=kv_unified, flash_attn=flash_attn, type_k=type_k)
    decode(dst, [1, 2, 3, 4], [0, 1, 2, 3], [1, 1, 1, 1])  # overwritten by the restore
    assert dst.state_set_data(data) == len(data)
    # cells come back compactly at 0..n-1 with every head at 0 (llama_kv_cache::state_read_meta)
    for (name, s, cells, head), (_, _, cells_dst, head_dst) in zip(view(src), view(dst)):
        assert cells_dst == cells
        assert head_dst == 0
    if not kv_unified:  # both streams survive (0c1e570)
        assert [c[0] for c in dst.memory.cells(0)[:3]] == [0, 1, 2]
        assert [c[0] for c in dst.memory.cells(1)[:2]] == [0, 1]
    for a, b in zip(tensors(src), tensors(dst)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bit for bit
    assert dst.state_get_data() == data
    batch = ([10, 11], [3, 2], [0, 1])
    assert torch.equal(next_logits(src, *batch), next_logits(dst, *batch))


def test_whole_restore_compacts_scattered_cells(model):
    src = make_ctx(model)
    decode(src, list(range(1, 9)), range(8), [0] * 8)
    src.memory.seq_rm(0, 2, 5)  # cells 2-4 freed: 0,1,5,6,7 remain
    decode(src, [20, 21], [0, 1], [1, 1])  # seq 1 lands in cells 2, 3
    before = src.memory.cells()
    used = [i for i, c in enumerate(before) if c[0] >= 0]
    data = src.state_get_data()
    dst = make_ctx(model)
    dst.state_set_data(data)
    assert dst.memory.cells()[:len(used)] == [before[i] for i in used]
    assert all(c[0] == -1 for c in dst.memory.cells()[len(used):])
    assert_same_rows(kv_rows(src.memory, 0, used), kv_rows(dst.memory, 0, range(len(used))))
    batch = ([30], [8], [0])
    torch.testing.assert_close(next_logits(src, *batch), next_logits(dst, *batch), rtol=1e-5, atol=1e-5)


def test_whole_restore_into_a_larger_cache(model):
    src = make_ctx(model)
    fill_two_seqs(src)
    dst = make_ctx(model, n_ctx=64)
    dst.state_set_data(src.state_get_data())
    assert dst.memory.cells()[:5] == src.memory.cells()[:5]
    assert dst.memory.used() == 5


def test_empty_whole_state_clears(model):
    empty = make_ctx(model).state_get_data()
    ctx = make_ctx(model)
    fill_two_seqs(ctx)
    ctx.state_set_data(empty)
    assert view(ctx) == empty_view(ctx)


# ---- single-sequence round trips -----------------------------------------------------------------------
@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("type_k", ["f32", "f16"])
def test_seq_round_trip_is_bit_exact(model, kv_unified, flash_attn, type_k):
    src = make_ctx(model, kv_unified=kv_unified, flash_attn=flash_attn, type_k=type_k)
    decode(src, [5, 6, 7, 8, 9], range(5), [0] * 5)
    data = src.state_seq_get_data(0)
    dst = make_ctx(model, kv_unified=kv_unified, flash_attn=flash_attn, type_k=type_k)
    assert dst.state_seq_set_data(data, 0) == len(data)
    assert view(dst) == view(src)  # same cells, head after the last placed cell (apply_ubatch)
    for a, b in zip(tensors(src), tensors(dst)):
        assert torch.equal(a, b)
    batch = ([10], [5], [0])
    assert torch.equal(next_logits(src, *batch), next_logits(dst, *batch))


@pytest.mark.parametrize("kv_unified", [True, False])
def test_seq_restore_into_another_seq_id(model, kv_unified):
    src = make_ctx(model, kv_unified=kv_unified)
    fill_two_seqs(src)
    data = src.state_seq_get_data(1)
    dst = make_ctx(model, kv_unified=kv_unified)
    decode(dst, [1, 2, 3], [0, 1, 2], [1, 1, 1])
    dst.state_seq_set_data(data, 0)  # the saved id (1) is ignored
    dest_stream = 0
    src_stream = 0 if kv_unified else 1
    got = dst.memory.cells(dest_stream)
    placed = [i for i, c in enumerate(got) if 0 in c[1]]
    assert [got[i] for i in placed] == [(0, frozenset({0}), 0), (1, frozenset({0}), 0)]
    assert placed == ([3, 4] if kv_unified else [0, 1])
    assert dst.memory.head(dest_stream) == placed[-1] + 1
    src_cells = [i for i, c in enumerate(src.memory.cells(src_stream)) if 1 in c[1]]
    assert_same_rows(kv_rows(src.memory, src_stream, src_cells), kv_rows(dst.memory, dest_stream, placed))
    # seq 1 of dst is untouched
    assert dst.memory.seq_pos_max(1) == 2


def test_seq_restore_replaces_the_destination(model):
    src = make_ctx(model)
    decode(src, [5, 6], [0, 1], [0, 0])
    dst = make_ctx(model)
    decode(dst, [1, 2, 3, 4], range(4), [0] * 4)
    dst.state_seq_set_data(src.state_seq_get_data(0), 0)
    # seq_rm(dest) first freed cells 0-3 (head 0), then find_slot placed the two cells there
    assert dst.memory.cells()[:4] == [(0, frozenset({0}), 0), (1, frozenset({0}), 0)] + [(-1, frozenset(), 0)] * 2
    assert dst.memory.head() == 2


def test_seq_restore_into_a_scattered_cache(model):
    src = make_ctx(model)
    decode(src, [5, 6, 7, 8], range(4), [0] * 4)
    data = src.state_seq_get_data(0)
    dst = make_ctx(model)
    decode(dst, list(range(1, 9)), range(8), [0] * 8)
    dst.memory.seq_rm(0, 2, 4)  # frees cells 2, 3: head 2
    assert dst.memory.head() == 2
    dst.state_seq_set_data(data, 1)
    cells = dst.memory.cells()
    placed = [i for i, c in enumerate(cells) if 1 in c[1]]
    assert placed == [2, 3, 8, 9]  # scan from head 2: the gap, then after the used cells
    assert [cells[i][0] for i in placed] == [0, 1, 2, 3]
    assert dst.memory.head() == 10
    assert_same_rows(kv_rows(src.memory, 0, range(4)), kv_rows(dst.memory, 0, placed))
    a = next_logits(src, [9], [4], [0])
    b = next_logits(dst, [9], [4], [1])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_seq_state_of_absent_seq_leaves_destination(model):
    """QUIRK (llama.cpp): seq_rm(dest) runs only for a stream with cells, so an empty sequence
    state leaves the destination as it was."""
    data = make_ctx(model).state_seq_get_data(0)
    ctx = make_ctx(model)
    decode(ctx, [1, 2], [0, 1], [0, 0])
    before = view(ctx)
    ctx.state_seq_set_data(data, 0)
    assert view(ctx) == before


def test_quantized_round_trip():
    model = in_memory_model(head_dim=32, n_embd=64)  # rows of whole 32-value blocks
    try:
        src = make_ctx(model, type_k="q8_0", type_v="q8_0", flash_attn="on")
    except (ContextParamsError, KvscopeError):
        pytest.skip("quantized cache types are not available yet")
    fill_two_seqs(src)
    dst = make_ctx(model, type_k="q8_0", type_v="q8_0", flash_attn="on")
    dst.state_set_data(src.state_get_data())
    for a, b in zip(tensors(src), tensors(dst)):
        assert torch.equal(a, b)
    assert torch.equal(next_logits(src, [3], [3], [0]), next_logits(dst, [3], [3], [0]))


# ---- files -------------------------------------------------------------------------------------------
def test_session_file_round_trip(model, tmp_path):
    src = make_ctx(model)
    fill_two_seqs(src)
    path = tmp_path / "session.bin"
    size = src.state_save_file(path, [5, 6, 7, 8, 9])
    raw = path.read_bytes()
    assert size == len(raw)
    assert struct.unpack_from("<III", raw) == (0x6767736E, 9, 5)
    assert struct.unpack_from("<5i", raw, 12) == (5, 6, 7, 8, 9)
    assert raw[32:] == src.state_get_data()
    dst = make_ctx(model)
    assert dst.state_load_file(path) == [5, 6, 7, 8, 9]
    assert [v[2] for v in view(dst)] == [v[2] for v in view(src)]
    with pytest.raises(StateFileError, match="exceeded capacity"):
        make_ctx(model).state_load_file(path, n_token_capacity=4)


def test_seq_file_round_trip(model, tmp_path):
    src = make_ctx(model, kv_unified=False)
    fill_two_seqs(src)
    path = tmp_path / "seq.bin"
    src.state_seq_save_file(path, 0, [5, 6, 7])
    raw = path.read_bytes()
    assert struct.unpack_from("<III", raw) == (0x67677371, 2, 3)
    assert raw[24:] == src.state_seq_get_data(0)[8:]  # no in-memory magic / seq id in files
    dst = make_ctx(model, kv_unified=False)
    assert dst.state_seq_load_file(path, 1) == [5, 6, 7]
    assert [c for c in dst.memory.cells(1) if c[0] >= 0] == [(p, frozenset({1}), 0) for p in range(3)]
    assert_same_rows(kv_rows(src.memory, 0, range(3)), kv_rows(dst.memory, 1, range(3)))


def test_session_file_with_trailing_bytes(model, tmp_path):
    src = make_ctx(model)
    fill_two_seqs(src)
    path = tmp_path / "session.bin"
    src.state_save_file(path, [1])
    path.write_bytes(path.read_bytes() + b"xx")
    dst = make_ctx(model)
    with pytest.raises(StateFileError, match="did not read all"):
        dst.state_load_file(path)
    assert dst.memory.cells()[:5] == src.memory.cells()[:5]  # llama.cpp restores, then reports


@pytest.mark.parametrize("which", ["session", "seq"])
def test_file_with_bad_magic_or_version(model, tmp_path, which):
    src = make_ctx(model)
    fill_two_seqs(src)
    path = tmp_path / "f.bin"
    if which == "session":
        src.state_save_file(path, [1, 2])
    else:
        src.state_seq_save_file(path, 0, [1, 2])
    good = path.read_bytes()
    dst = make_ctx(model)
    decode(dst, [1, 2, 3], [0, 1, 2], [0, 0, 0])
    before = view(dst)
    for bad in (b"xxxx" + good[4:], good[:4] + struct.pack("<I", 99) + good[8:]):
        path.write_bytes(bad)
        with pytest.raises(StateFileError, match="unknown \\(magic, version\\)"):
            dst.state_load_file(path) if which == "session" else dst.state_seq_load_file(path, 0)
        assert view(dst) == before


# ---- refusals ------------------------------------------------------------------------------------------
def prepared(model, **kw) -> Context:
    """A context holding seq 0 at 0-2 and seq 1 at 0-1, the target of the refused restores."""
    ctx = make_ctx(model, **kw)
    fill_two_seqs(ctx)
    return ctx


def assert_whole_refused(ctx: Context, data: bytes, match: str) -> None:
    with pytest.raises(StateFileError, match=match):
        ctx.state_set_data(data)
    assert view(ctx) == empty_view(ctx)  # clear(true)
    assert all(torch.count_nonzero(t) == 0 for t in tensors(ctx))


def assert_seq_refused(ctx: Context, data: bytes, dest: int, match: str) -> None:
    other = 1 - dest
    kept = [[c if dest not in c[1] else None for c in cells] for _, _, cells, _ in view(ctx)]
    with pytest.raises(StateFileError, match=match):
        ctx.state_seq_set_data(data, dest)
    for cache in caches(ctx):
        for s in range(cache.n_stream):
            assert all(dest not in c[1] for c in cache.cells(s))  # seq_rm(dest)
    assert ctx.memory.seq_pos_max(other) >= 0
    for (_, _, cells, _), before in zip(view(ctx), kept):
        assert [c for c in cells if c[0] >= 0] == [c for c in before if c is not None and c[0] >= 0]


OTHER_MODELS = [
    ({"n_layer": 3}, "mismatched layer count: the state has 2 layers, this cache has 3"),
    ({"head_dim": 16}, "mismatched key row size in layer 0: this cache has 64 bytes, the state has 32"),
]


@pytest.mark.parametrize("overrides,match", OTHER_MODELS)
def test_state_of_another_model_is_refused(model, overrides, match):
    src = prepared(model)
    other = in_memory_model(**overrides)
    assert_whole_refused(prepared(other), src.state_get_data(), match)
    assert_seq_refused(prepared(other), src.state_seq_get_data(0), 0, match)


@pytest.mark.parametrize("src_kw,dst_kw,match", [
    ({"type_k": "f32"}, {"type_k": "f16"},
     "mismatched key type in layer 0: this cache has f16 \\(ggml type 1\\), the state has f32 \\(ggml type 0\\)"),
    ({"type_k": "f16", "type_v": "f32", "flash_attn": "on"}, {"type_k": "f16", "type_v": "f16", "flash_attn": "on"},
     "mismatched value type in layer 0"),
    ({"flash_attn": "off"}, {"flash_attn": "on"}, "incompatible V transposition"),
    ({"flash_attn": "on"}, {"flash_attn": "off"}, "incompatible V transposition"),
    ({"type_k": "f32", "type_v": "f32", "flash_attn": "off"}, {"type_k": "f32", "type_v": "bf16", "flash_attn": "off"},
     "mismatched value type"),
])
def test_state_with_other_settings_is_refused(model, src_kw, dst_kw, match):
    src = prepared(model, **src_kw)
    assert_whole_refused(prepared(model, **dst_kw), src.state_get_data(), match)
    assert_seq_refused(prepared(model, **dst_kw), src.state_seq_get_data(1), 1, match)


@pytest.mark.parametrize("src_unified", [True, False])
def test_other_stream_count_is_refused_and_changes_nothing(model, src_unified):
    src = prepared(model, kv_unified=src_unified)
    for data, restore in ((src.state_get_data(), lambda c, d: c.state_set_data(d)),
                          (src.state_seq_get_data(0), lambda c, d: c.state_seq_set_data(d, 0))):
        dst = prepared(model, kv_unified=not src_unified)
        before, data_before = view(dst), tensors(dst)
        with pytest.raises(StateFileError, match="n_stream mismatch"):
            restore(dst, data)
        assert view(dst) == before  # thrown before anything changes (llama.cpp: before the clear)
        assert all(torch.equal(a, b) for a, b in zip(data_before, tensors(dst)))


def test_truncated_state_is_refused(model):
    src = prepared(model)
    whole, seq = src.state_get_data(), src.state_seq_get_data(0)
    for cut in (len(whole) - 3, 9 + 4 + 4 + 10):  # inside the V rows; inside the cell metadata
        assert_whole_refused(prepared(model), whole[:cut], "truncated")
    for cut in (len(seq) - 3, 8 + 4 + 4 + 10):
        assert_seq_refused(prepared(model), seq[:cut], 0, "truncated")
    # cut inside the arch string or n_stream: refused before the memory is touched
    for cut in (6, 9 + 2):
        dst = prepared(model)
        before = view(dst)
        with pytest.raises(StateFileError, match="truncated"):
            dst.state_set_data(whole[:cut])
        assert view(dst) == before


def test_bad_seq_magic_and_wrong_arch_change_nothing(model):
    src = prepared(model)
    dst = prepared(model)
    before = view(dst)
    seq = src.state_seq_get_data(0)
    with pytest.raises(StateFileError, match="wrong sequence state magic"):
        dst.state_seq_set_data(b"\0\0\0\0" + seq[4:], 0)
    with pytest.raises(StateFileError, match="wrong sequence state magic"):
        dst.state_seq_set_data(src.state_get_data(), 0)  # a whole state is not a sequence state
    whole = src.state_get_data()
    with pytest.raises(StateFileError, match="wrong model arch: 'qwen2' instead of 'llama'"):
        dst.state_set_data(struct.pack("<I", 5) + b"qwen2" + whole[9:])
    assert view(dst) == before


def test_more_cells_than_the_cache_is_refused(model):
    big = make_ctx(model, n_ctx=64)
    decode(big, list(range(40)), range(40), [0] * 40)
    assert_whole_refused(prepared(model), big.state_get_data(),
                         "not enough cells in kv cache: the state has 40 cells in this stream, this cache has 32")
    assert_seq_refused(prepared(model), big.state_seq_get_data(0), 0, "failed to find 40 available cells")


def test_seq_ids_beyond_n_seq_max_are_refused(model):
    src = make_ctx(model, n_seq_max=4)
    decode(src, [1, 2], [0, 1], [3, 3])
    assert_whole_refused(prepared(model), src.state_get_data(),
                         "invalid seq_id, 3 is out of range \\[0, 2\\)")


def test_seq_id_agnostic_cells_are_refused(model):
    """A unified cache accepts memory ops on seq ids up to 255; its seq ids >= n_seq_max are not
    written (n_seq_id 0), and a single-sequence restore refuses such cells."""
    src = make_ctx(model)
    decode(src, [1, 2], [0, 1], [0, 0])
    src.memory.seq_cp(0, 5)
    data = src.state_seq_get_data(5)
    p = Parser(data)
    p.take("Ii")
    assert p.cache()[0]["meta"] == [(0, []), (1, [])]
    assert_seq_refused(prepared(model), data, 0, "invalid seq_id-agnostic kv cell")


def test_invalid_destination_seq_changes_nothing(model):
    src = prepared(model, kv_unified=False)
    dst = prepared(model, kv_unified=False)
    before = view(dst)
    with pytest.raises(MemoryOperationError, match="invalid seq_id 5"):
        dst.state_seq_set_data(src.state_seq_get_data(0), 5)
    with pytest.raises(MemoryOperationError):
        src.state_seq_get_data(7)
    assert view(dst) == before


def test_unknown_flags_are_refused(model):
    with pytest.raises(StateFileError, match="unknown state flags"):
        prepared(model).state_seq_get_data(0, flags=8)


# ---- watchers -------------------------------------------------------------------------------------------
def assert_mirror_matches(mirror: CacheMirror, ctx: Context) -> None:
    mirror.sync()
    assert not mirror.stale
    for cache in caches(ctx):
        for s in range(cache.n_stream):
            assert mirror.cells(s, cache=cache.name) == cache.cells(s)
            assert mirror.head(s, cache=cache.name) == cache.head(s)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_mirror_follows_restores(model, kv_unified):
    bus = EventBus()
    mirror = CacheMirror()
    mirror.attach(bus)
    ctx = make_ctx(model, kv_unified=kv_unified, bus=bus)
    fill_two_seqs(ctx)
    whole, seq0 = ctx.state_get_data(), ctx.state_seq_get_data(0)
    ctx.memory.seq_rm(0, 1, -1)
    decode(ctx, [1, 2, 3], [1, 2, 3], [0, 0, 0])
    assert_mirror_matches(mirror, ctx)
    ctx.state_set_data(whole)
    assert_mirror_matches(mirror, ctx)
    ctx.state_seq_set_data(seq0, 1)  # seq 1 replaced by a copy of seq 0
    assert_mirror_matches(mirror, ctx)
    other = prepared(in_memory_model(n_layer=3), kv_unified=kv_unified)
    with pytest.raises(StateFileError):
        ctx.state_seq_set_data(other.state_seq_get_data(0), 0)
    assert_mirror_matches(mirror, ctx)
    with pytest.raises(StateFileError):
        ctx.state_set_data(other.state_get_data())
    assert_mirror_matches(mirror, ctx)
    ctx.state_set_data(whole)
    decode(ctx, [4], [3], [0])
    assert_mirror_matches(mirror, ctx)


def test_mirror_follows_a_scattered_seq_restore(model):
    src = make_ctx(model)
    decode(src, [5, 6, 7, 8], range(4), [0] * 4)
    bus = EventBus()
    mirror = CacheMirror()
    mirror.attach(bus)
    dst = make_ctx(model, bus=bus)
    decode(dst, list(range(1, 9)), range(8), [0] * 8)
    dst.memory.seq_rm(0, 2, 4)
    dst.state_seq_set_data(src.state_seq_get_data(0), 1)
    assert_mirror_matches(mirror, dst)


# ---- iSWA ------------------------------------------------------------------------------------------------
def test_iswa_state_is_base_then_swa(swa_model):
    ctx = make_ctx(swa_model, n_seq_max=1)
    assert [c.name for c in caches(ctx)] == ["base", "swa"]
    decode(ctx, list(range(1, 11)), range(10), [0] * 10)
    p = Parser(ctx.state_seq_get_data(0))
    p.take("Ii")
    (base,) = p.cache()
    (swa,) = p.cache()
    assert p.off == len(p.data)
    assert [m[0] for m in base["meta"]] == list(range(10))
    # window 4 against the seq's max position 9 (not 10): positions 6-9 are kept
    assert [m[0] for m in swa["meta"]] == [6, 7, 8, 9]
    assert len(base["k"]) == 1 and len(swa["k"]) == 1  # one layer in each cache
    # PARTIAL_ONLY: the SWA cache only
    p = Parser(ctx.state_seq_get_data(0, flags=st.STATE_SEQ_FLAGS_PARTIAL_ONLY))
    p.take("Ii")
    (only,) = p.cache()
    assert p.off == len(p.data) and only["meta"] == swa["meta"]
    # the whole state keeps every cell of both caches
    p = Parser(ctx.state_get_data())
    p.take("I"), p.raw(5)
    assert [len(p.cache()[0]["meta"]) for _ in range(2)] == [10, 10]


def test_iswa_round_trips(swa_model):
    src = make_ctx(swa_model, n_seq_max=1)
    decode(src, list(range(1, 11)), range(10), [0] * 10)
    whole, seq, partial = (src.state_get_data(), src.state_seq_get_data(0),
                           src.state_seq_get_data(0, flags=st.STATE_SEQ_FLAGS_PARTIAL_ONLY))
    dst = make_ctx(swa_model, n_seq_max=1)
    dst.state_set_data(whole)
    assert [v[2] for v in view(dst)] == [v[2] for v in view(src)]
    for a, b in zip(tensors(src), tensors(dst)):
        assert torch.equal(a, b)
    # heads are 0 after a whole restore, so the SWA cache reuses its masked cell 0 where the
    # source (head 10) takes cell 10: same attention inputs, other cell order
    a, b = next_logits(src, [3], [10], [0]), next_logits(dst, [3], [10], [0])
    assert src.memory.swa.cells()[10][0] == 10 and dst.memory.swa.cells()[0][0] == 10
    assert dst.memory.base.cells() == src.memory.base.cells()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    dst = make_ctx(swa_model, n_seq_max=1)
    dst.state_seq_set_data(seq, 0)
    assert [c[0] for c in dst.memory.base.cells()[:10]] == list(range(10))
    assert [c[0] for c in dst.memory.swa.cells()[:5]] == [6, 7, 8, 9, -1]
    assert dst.memory.seq_pos_min(0) == 6

    dst = make_ctx(swa_model, n_seq_max=1)
    decode(dst, [1, 2], [0, 1], [0, 0])
    base_before = dst.memory.base.cells()
    dst.state_seq_set_data(partial, 0, flags=st.STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert dst.memory.base.cells() == base_before
    assert [c[0] for c in dst.memory.swa.cells()[:4]] == [6, 7, 8, 9]


def test_iswa_mirror_and_refusal(swa_model, model):
    bus = EventBus()
    mirror = CacheMirror()
    mirror.attach(bus)
    ctx = make_ctx(swa_model, n_seq_max=1, bus=bus)
    decode(ctx, list(range(1, 7)), range(6), [0] * 6)
    whole = ctx.state_get_data()
    ctx.memory.clear()
    ctx.state_set_data(whole)
    assert_mirror_matches(mirror, ctx)
    other = make_ctx(model, n_seq_max=1)
    decode(other, [1, 2], [0, 1], [0, 0])
    swa_before = [ctx.memory.swa.cells(), ctx.memory.swa.head()]
    with pytest.raises(StateFileError, match="'base'.*mismatched layer count: the state has 2 layers, this cache "
                                             "has 1.*the cache was cleared"):
        ctx.state_set_data(other.state_get_data())
    # the base cache failed and was cleared; the SWA cache, never read, is as it was (llama.cpp)
    assert ctx.memory.base.used() == 0 and ctx.memory.base.head() == 0
    assert [ctx.memory.swa.cells(), ctx.memory.swa.head()] == swa_before
    assert_mirror_matches(mirror, ctx)
