"""Sliding-window scenarios (S10, S12, S13, S14, S16; the full-attention ones are in test_scenarios.py) as
exact cell tables, following llama.cpp's llama_kv_cache::find_slot and apply_ubatch (src/llama-kv-cache.cpp)
and is_masked_swa (src/llama-hparams.cpp).

The caches are built directly (kv sizes chosen freely, below llama.cpp's padding) and driven through the same
steps as Context.decode: batch validation, update, split + dry run, apply. The model's forward
pass does not change cell metadata, so it is left out here; the logits of sliding-window models
are checked against transformers in test_architectures.py.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine import events as ev
from engine.batch import Batch, BatchAllocator
from engine.kv.cache import KVCache
from engine.kv.iswa import KVCacheISWA, swa_cache_size
from engine.kv.layout import CacheLayout
from engine.kv.swa import SwaType, is_masked_swa
from engine.kv.types import cache_type
from engine.watch.mirror import CacheMirror

N_VOCAB = 64


def no_rope(il: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return keys


def make_cache(bus: ev.EventBus, kv_size: int, *, n_swa: int = 0, swa_type: SwaType = SwaType.NONE,
               name: str = "swa", n_stream: int = 1, n_seq_max: int = 4) -> KVCache:
    layout = CacheLayout(layer_ids=(0,), n_embd_k=8, n_embd_v=8, n_head_kv=1, head_dim=8, kv_size=kv_size,
                         n_stream=n_stream, n_seq_max=n_seq_max, type_k=cache_type("f32"),
                         type_v=cache_type("f32"), v_trans=False, pad=1, n_swa=n_swa, swa_type=swa_type)
    cache = KVCache(layout, bus=bus, key_shifter=no_rope, name=name)
    bus.publish(ev.ContextCreated(cache=name, n_ctx=kv_size, n_ctx_seq=kv_size, kv_size=kv_size, n_stream=n_stream,
                                  n_seq_max=n_seq_max, n_layer=1, type_k="f32", type_v="f32", v_trans=False,
                                  k_bytes=0, v_bytes=0, n_batch=64, n_ubatch=64, pad=1, unified=n_stream == 1,
                                  model_name="none", log_lines=(), n_swa=n_swa, swa_type=int(swa_type)))
    return cache


class Driver:
    """Decodes metadata-only batches into a memory and checks the mirror after every step."""

    def __init__(self, memory, bus: ev.EventBus, mirror: CacheMirror, n_ubatch: int = 64) -> None:
        self.memory, self.bus, self.mirror, self.n_ubatch = memory, bus, mirror, n_ubatch

    def decode(self, positions: list[int], seq_id: int = 0) -> int:
        batch = Batch([1] * len(positions), positions, [[seq_id]] * len(positions))
        alloc = BatchAllocator(batch, n_vocab=N_VOCAB, n_seq_max=self.memory.n_seq_max, memory=self.memory)
        self.memory.update()
        plan = self.memory.init_batch(alloc, self.n_ubatch)
        if plan is not None:
            for k, (ub, sinfo) in enumerate(zip(*plan)):
                self.memory.apply_ubatch(sinfo, ub, ubatch_index=k)
        self.check_mirror()
        return 0 if plan is not None else 1

    def check_mirror(self) -> None:
        self.mirror.sync()
        for cache in self.memory.caches():
            for s in range(cache.n_stream):
                assert self.mirror.cells(s, cache.name) == cache.cells(s), f"mirror of {cache.name} differs"
                assert self.mirror.head(s, cache.name) == cache.head(s)


def table(cache: KVCache, stream: int = 0) -> str:
    """Cells in test_scenarios.py's notation: 'idx:pPOS{seqs}' for every non-empty cell."""
    out = []
    for i, (pos, seqs, shift) in enumerate(cache.cells(stream)):
        if pos >= 0:
            out.append(f"{i}:p{pos}{{{','.join(map(str, sorted(seqs)))}}}" + (f"[{shift:+d}]" if shift else ""))
    return " ".join(out)


def expand(text: str) -> str:
    """'0-2:p5-p7{0}' -> '0:p5{0} 1:p6{0} 2:p7{0}' so tables can be written with ranges."""
    parts = []
    for item in text.split():
        m = re.fullmatch(r"(\d+)-(\d+):p(\d+)-p(\d+)(\{[\d,]*\})", item)
        if m:
            a, b, p, q, seqs = m.groups()
            assert int(b) - int(a) == int(q) - int(p)
            parts += [f"{i}:p{int(p) + k}{seqs}" for k, i in enumerate(range(int(a), int(b) + 1))]
        else:
            parts.append(item)
    return " ".join(parts)


@pytest.fixture
def bus_mirror():
    bus = ev.EventBus()
    mirror = CacheMirror()
    mirror.attach(bus)
    return bus, mirror


def test_s10_standard_swa_reuse(bus_mirror):
    bus, mirror = bus_mirror
    swa = make_cache(bus, 8, n_swa=4, swa_type=SwaType.STANDARD)
    d = Driver(swa, bus, mirror)
    assert d.decode([0, 1, 2, 3, 4, 5]) == 0
    assert (table(swa), swa.head(0)) == (expand("0-5:p0-p5{0}"), 6)
    assert d.decode([6]) == 0 and d.decode([7]) == 0
    assert swa.head(0) == 8
    assert d.decode([8]) == 0  # h8 wraps; cell 0 (p0; 8 - 0 >= 4) is reused
    assert (table(swa), swa.head(0), swa.seq_pos_min(0)) == (expand("0:p8{0} 1-7:p1-p7{0}"), 1, 1)
    assert d.decode([9, 10, 11]) == 0
    assert table(swa) == expand("0-3:p8-p11{0} 4-7:p4-p7{0}")
    assert (swa.head(0), swa.seq_pos_min(0), swa.seq_pos_max(0)) == (4, 4, 11)


def test_s12_swa_purge_and_seq_add_head_reset(bus_mirror):
    bus, mirror = bus_mirror
    swa = make_cache(bus, 8, n_swa=2, swa_type=SwaType.STANDARD)
    d = Driver(swa, bus, mirror)
    assert d.decode(list(range(8))) == 0
    assert d.decode([8]) == 0 and d.decode([9]) == 0
    assert (table(swa), swa.head(0)) == (expand("0:p8{0} 1:p9{0} 2-7:p2-p7{0}"), 2)
    swa.seq_add(0, 100, -1, +1)  # nothing in range, yet the head goes to 0
    d.check_mirror()
    assert swa.head(0) == 0
    purges = bus.subscribe(kinds=(ev.CellsRemoved,))
    assert d.decode([10]) == 0  # cell 0 (p8) is usable and comes first; the purge frees cells 2-7
    assert (table(swa), swa.head(0)) == ("0:p10{0} 1:p9{0}", 1)
    removed = purges.drain()
    assert [(e.reason, e.p0, e.p1, e.tentative) for e in removed] == [("purge", 2, 9, True)], \
        "the purge happens once, in the dry run, and persists"
    assert "QUIRK" in removed[0].quirk
    assert d.decode([11]) == 0  # cell 1 (p9) is reused although empty cells exist
    assert (table(swa), swa.head(0)) == ("0:p10{0} 1:p11{0}", 2)


def test_s13_chunked_swa(bus_mirror):
    bus, mirror = bus_mirror
    swa = make_cache(bus, 8, n_swa=4, swa_type=SwaType.CHUNKED)
    d = Driver(swa, bus, mirror)
    assert d.decode(list(range(8))) == 0
    assert d.decode([8]) == 0  # chunk start 8: every cell is masked, cell 0 is taken
    assert (swa.head(0), table(swa).split()[0]) == (1, "0:p8{0}")
    assert d.decode([9, 10, 11]) == 0
    assert (table(swa), swa.head(0)) == (expand("0-3:p8-p11{0} 4-7:p4-p7{0}"), 4)
    assert d.decode([12]) == 0  # chunk start 12: cell 4 is taken
    assert (swa.head(0), swa.seq_pos_min(0)) == (5, 5)
    assert table(swa) == expand("0-3:p8-p11{0} 4:p12{0} 5-7:p5-p7{0}")


def test_s14_iswa_pair(bus_mirror):
    bus, mirror = bus_mirror
    base = make_cache(bus, 8, name="base")
    swa = make_cache(bus, 4, n_swa=2, swa_type=SwaType.STANDARD)
    pair = KVCacheISWA(base, swa, unified=True, swa_full=False)
    d = Driver(pair, bus, mirror)
    assert d.decode([0, 1, 2]) == 0 and d.decode([3]) == 0
    assert (table(swa), swa.head(0)) == (expand("0-3:p0-p3{0}"), 4)
    assert d.decode([4]) == 0
    assert (table(base), base.head(0)) == (expand("0-4:p0-p4{0}"), 5)
    assert (table(swa), swa.head(0)) == (expand("0:p4{0} 1-3:p1-p3{0}"), 1)
    assert (pair.seq_pos_min(0), pair.seq_pos_max(0)) == (1, 4)  # answered by the SWA cache
    assert d.decode([5, 6, 7]) == 0
    swa_before = (swa.cells(0), swa.head(0))
    searches = bus.subscribe(kinds=(ev.SlotSearchFailed,))
    assert d.decode([8]) == 1  # the base is full although the SWA cache could reuse a cell
    assert [e.cache for e in searches.drain()] == ["base", "base"], "simple split, then the equal retry"
    assert (swa.cells(0), swa.head(0)) == swa_before


def test_s16_symmetric_swa(bus_mirror):
    bus, mirror = bus_mirror
    swa = make_cache(bus, 8, n_swa=4, swa_type=SwaType.SYMMETRIC)
    d = Driver(swa, bus, mirror)
    assert d.decode(list(range(8))) == 0
    assert d.decode([8, 9]) == 0
    assert table(swa) == expand("0:p8{0} 1:p9{0} 2-7:p2-p7{0}")
    assert (swa.head(0), swa.seq_pos_min(0)) == (2, 2)


def test_masked_single_seq_cells_only_are_reused(bus_mirror):
    """Cells with two sequences are never reused, however old (llama_kv_cache::find_slot reuses a masked
    cell only when it holds a single sequence); the purge that keeps seq 0 gap-free then removes seq 0
    from them."""
    bus, mirror = bus_mirror
    swa = make_cache(bus, 4, n_swa=1, swa_type=SwaType.STANDARD)
    d = Driver(swa, bus, mirror)
    alloc = BatchAllocator(Batch([1, 1], [0, 1], [[0, 1], [0, 1]]), n_vocab=N_VOCAB, n_seq_max=4, memory=swa)
    ubs, slots = swa.init_batch(alloc, 8)
    swa.apply_ubatch(slots[0], ubs[0])
    assert d.decode([2, 3], seq_id=0) == 0
    assert d.decode([4, 5, 6], seq_id=0) == 1  # only cells 2 and 3 are masked single-seq cells
    assert d.decode([4], seq_id=0) == 0  # cell 2 (p2) is taken; purge seq_rm(0, 0, 3)
    assert table(swa) == "0:p0{1} 1:p1{1} 2:p4{0} 3:p3{0}"
    assert (swa.seq_pos_min(0), swa.seq_pos_min(1)) == (3, 0)


@pytest.mark.parametrize("kv_size,n_swa,unified,n_seq_max,n_ubatch,pad,swa_full,expected", [
    (4096, 1024, True, 1, 512, 256, False, 1536),  # PAD256(1024 + 512)
    (4096, 1024, True, 4, 512, 256, False, 4096),  # min(4096, 4 x 1024 + 512)
    (4096, 1024, False, 4, 512, 256, False, 1536),  # per stream: one sequence's window
    (4096, 1024, True, 1, 512, 256, True, 4096),  # swa_full
    (8, 2, True, 1, 1, 256, False, 256),  # a tiny instantiation pads past kv_size, as llama.cpp would
])
def test_swa_cache_size(kv_size, n_swa, unified, n_seq_max, n_ubatch, pad, swa_full, expected):
    assert swa_cache_size(kv_size, n_swa, unified=unified, n_seq_max=n_seq_max, n_ubatch=n_ubatch, pad=pad,
                          swa_full=swa_full) == expected


def test_is_masked_swa_rules():
    p0 = np.arange(10)
    assert list(np.flatnonzero(is_masked_swa(4, SwaType.STANDARD, p0, 8))) == [0, 1, 2, 3, 4]
    assert list(np.flatnonzero(is_masked_swa(4, SwaType.CHUNKED, p0, 9))) == list(range(8))
    assert list(np.flatnonzero(is_masked_swa(4, SwaType.SYMMETRIC, p0, 5))) == [0, 1, 2, 8, 9]
    assert not is_masked_swa(4, SwaType.NONE, p0, 100).any()
