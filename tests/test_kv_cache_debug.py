"""LLAMA_KV_CACHE_DEBUG: the find_slot dump and the SWA purge line, text for text as llama.cpp logs them
(src/llama-kv-cache.cpp, llama_kv_cache::find_slot and apply_ubatch).

Expected strings are written from llama.cpp's format strings, not produced by engine/kv/slot_debug.py.
One log record is one LLAMA_LOG_DEBUG call, without the call's final newline (the handler adds it).
Most caches are driven metadata-only, as in test_swa_scenarios.py; S4 also runs through a Context.
"""
from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest

import engine
from engine import events as ev
from engine.batch import Batch, BatchAllocator
from engine.errors import ContextParamsError
from engine.kv.factory import build_memory
from engine.kv.swa import SwaType
from tests.model_factory import in_memory_model, tiny_config
from tests.test_swa_scenarios import N_VOCAB, make_cache, no_rope

LOGGER = "kvscope.kv"


def decode(memory, entries, n_ubatch: int = 512) -> int:
    """entries: (seq or tuple of seqs, pos) in batch order. Placement only, as Context.decode does it."""
    seqs = [list(s) if isinstance(s, tuple) else [s] for s, _ in entries]
    batch = Batch([1] * len(entries), [p for _, p in entries], seqs)
    alloc = BatchAllocator(batch, n_vocab=N_VOCAB, n_seq_max=memory.n_seq_max, memory=memory)
    memory.update()
    plan = memory.init_batch(alloc, n_ubatch)
    if plan is None:
        return 1
    for k, (ub, sinfo) in enumerate(zip(*plan)):
        memory.apply_ubatch(sinfo, ub, ubatch_index=k)
    return 0


def seq_run(seq, p0: int, p1: int):
    return [(seq, p) for p in range(p0, p1 + 1)]


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def cache(kv_size: int, *, level: int, **kw):
    c = make_cache(ev.EventBus(), kv_size, **kw)
    c.debug_level = level
    return c


@pytest.fixture
def debug_log(caplog):
    caplog.set_level(logging.DEBUG, logger="kvscope")
    return caplog


# ---- S4 (tests/test_scenarios.py): multi-seq tokens, plain cache of 8 cells ---------------------------
S4_BEFORE_PAIR = [  # the state before [s0p3, s1p3]: 0-2:p0-p2{0,1}, h3
    "find_slot: stream[0], n =     3, used =     3, head =     3, size =     8, n_swa =     0",
    "\nMMM.....",
    "\n0    1    2    .    .    .    .    .    ",
    "find_slot: stream[0] min[0] =     0, max[0] =     2",
    "find_slot: stream[0] min[1] =     0, max[1] =     2",
]
S4_AFTER_PAIR = [  # S4: what the next find_slot prints (llama.cpp said size = 256 only for its padding)
    "find_slot: stream[0], n =     5, used =     5, head =     5, size =     8, n_swa =     0",
    "\nMMM01...",
    "\n0    1    2    3    3    .    .    .    ",
    "find_slot: stream[0] min[0] =     0, max[0] =     3",
    "find_slot: stream[0] min[1] =     0, max[1] =     3",
]


def test_s4_dump_once_per_unique_seq_of_the_ubatch(debug_log):
    """The decode [s0p3, s1p3] prints the whole block twice (one per unique seq, both the state before
    it); the probe decode after it prints the dump of S4's final state."""
    kv = cache(8, level=3, n_seq_max=10)
    assert decode(kv, seq_run((0, 1), 0, 2)) == 0
    debug_log.clear()
    assert decode(kv, [(0, 3), (1, 3)]) == 0
    assert messages(debug_log) == S4_BEFORE_PAIR + S4_BEFORE_PAIR
    debug_log.clear()
    assert decode(kv, [(2, 0)]) == 0
    assert messages(debug_log) == S4_AFTER_PAIR


def test_s4_through_a_context_with_the_environment_variable(monkeypatch, caplog):
    """The real decode path: the variable is read when the context builds its cache."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "3")
    ctx = engine.Context(in_memory_model(), n_ctx=8, pad=8, n_seq_max=10, kv_unified=True, type_k="f32",
                         type_v="f32")
    assert [c.debug_level for c in ctx.memory.caches()] == [3]
    ctx.decode(engine.Batch(tokens=[1, 2, 3], pos=[0, 1, 2], seq_ids=[[0, 1]] * 3))
    ctx.decode(engine.Batch(tokens=[4, 5], pos=[3, 3], seq_ids=[[0], [1]]))
    caplog.clear()  # only the next decode's dump: an earlier test may have left kvscope's logger at DEBUG
    with caplog.at_level(logging.DEBUG, logger="kvscope"):
        assert ctx.decode(engine.Batch(tokens=[6], pos=[0], seq_ids=[[2]])) == 0
    assert [m for m in messages(caplog) if m.startswith(("find_slot", "\n"))] == S4_AFTER_PAIR


# ---- levels ---------------------------------------------------------------------------------------
def test_level_1_prints_the_summary_only(debug_log):
    kv = cache(8, level=1, n_seq_max=10)
    decode(kv, seq_run((0, 1), 0, 2))
    debug_log.clear()
    decode(kv, [(0, 3), (1, 3)])
    assert messages(debug_log) == [S4_BEFORE_PAIR[0]] * 2


def test_level_2_shows_cells_only_on_a_swa_cache(debug_log):
    plain = cache(8, level=2)
    decode(plain, seq_run(0, 0, 5))
    debug_log.clear()
    decode(plain, [(0, 6)])
    assert messages(debug_log) == [
        "find_slot: stream[0], n =     6, used =     6, head =     6, size =     8, n_swa =     0"]

    swa = cache(8, level=2, n_swa=4, swa_type=SwaType.STANDARD)
    decode(swa, seq_run(0, 0, 5))
    debug_log.clear()
    decode(swa, [(0, 6)])
    assert messages(debug_log) == [
        "find_slot: stream[0], n =     6, used =     6, head =     6, size =     8, n_swa =     4",
        "\n000000..",
        "\n0    1    2    3    4    5    .    .    ",
        "find_slot: stream[0] min[0] =     0, max[0] =     5",
    ]


def test_level_0_logs_nothing(debug_log):
    kv = cache(8, level=0, n_swa=2, swa_type=SwaType.STANDARD)
    for positions in (seq_run(0, 0, 7), [(0, 8)], [(0, 9)]):  # the last two wrap and reuse masked cells
        assert decode(kv, positions) == 0
    assert messages(debug_log) == []


# ---- layout of big caches -------------------------------------------------------------------------
def test_rows_of_256_in_the_map_and_of_64_positions(debug_log):
    """300 cells: the map breaks after cell 255 with " *"; positions get a newline after every 64 cells,
    " *" before the one after cell 255, and a position wider than 5 is printed unpadded. Seq 12 is
    two characters in the map (std::to_string)."""
    kv = cache(300, level=3, n_seq_max=16)
    assert decode(kv, seq_run(0, 0, 269)) == 0
    assert decode(kv, [(12, 123456)]) == 0
    debug_log.clear()
    assert decode(kv, [(1, 0)]) == 0

    def row(p0, p1):
        return "".join(str(p).ljust(5) for p in range(p0, p1 + 1))

    assert row(60, 63) == "60   61   62   63   "
    assert messages(debug_log) == [
        "find_slot: stream[0], n =   271, used =   271, head =   271, size =   300, n_swa =     0",
        "\n" + "0" * 256 + " *\n" + "0" * 14 + "12" + "." * 29,
        "\n" + row(0, 63) + "\n" + row(64, 127) + "\n" + row(128, 191) + "\n" + row(192, 255) + " *\n"
        + row(256, 269) + "123456" + ".    " * 29,
        "find_slot: stream[0] min[0] =     0, max[0] =   269",
        "find_slot: stream[0] min[12] = 123456, max[12] = 123456",
    ]


def test_a_multiple_of_256_cells_ends_the_dump_with_an_empty_line(monkeypatch):
    """Byte for byte through a handler: llama.cpp's ss ends with " *\\n" and its format adds "\\n"."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "3")
    kv = make_cache(ev.EventBus(), 256)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        decode(kv, [(0, 0)])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    empty_row = ".    " * 64
    assert out.getvalue() == (
        "find_slot: stream[0], n =     0, used =     0, head =     0, size =   256, n_swa =     0\n"
        "\n" + "." * 256 + " *\n\n"
        "\n" + (empty_row + "\n") * 3 + empty_row + " *\n\n")


# ---- split streams ---------------------------------------------------------------------------------
def test_split_streams_print_each_seq_s_own_stream(debug_log):
    """S11: U1 = s0p0,s0p1,s1p0,s1p1 dumps streams 0 and 1 (empty); U2 = s0p2 dumps stream 0 with U1
    tentatively placed; a later decode of seq 1 dumps stream 1, whose seq shows as '1'."""
    kv = cache(4, level=3, n_stream=2, n_seq_max=2)
    assert decode(kv, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], n_ubatch=8) == 0

    def empty(s):
        return [f"find_slot: stream[{s}], n =     0, used =     0, head =     0, size =     4, n_swa =     0",
                "\n....", "\n.    .    .    .    "]

    assert messages(debug_log) == empty(0) + empty(1) + [
        "find_slot: stream[0], n =     2, used =     2, head =     2, size =     4, n_swa =     0",
        "\n00..",
        "\n0    1    .    .    ",
        "find_slot: stream[0] min[0] =     0, max[0] =     1",
    ]
    debug_log.clear()
    assert decode(kv, [(1, 2)]) == 0
    assert messages(debug_log) == [
        "find_slot: stream[1], n =     2, used =     2, head =     2, size =     4, n_swa =     0",
        "\n11..",
        "\n0    1    .    .    ",
        "find_slot: stream[1] min[1] =     0, max[1] =     1",
    ]


# ---- the SWA purge -----------------------------------------------------------------------------------
def test_s12_purge_line_follows_the_dump_once_in_the_dry_run(debug_log):
    """S12 (tests/test_swa_scenarios.py): decoding pos 10 takes cell 0 (p8) and purges [2, 8], logged by
    apply_ubatch."""
    kv = cache(8, level=2, n_swa=2, swa_type=SwaType.STANDARD)
    kv.debug_level = 0
    for positions in (seq_run(0, 0, 7), [(0, 8)], [(0, 9)]):
        assert decode(kv, positions) == 0
    kv.seq_add(0, 100, -1, 1)  # nothing in range; the head goes to 0
    kv.debug_level = 2
    debug_log.clear()
    assert decode(kv, [(0, 10)]) == 0
    assert messages(debug_log) == [
        "find_slot: stream[0], n =     8, used =     8, head =     0, size =     8, n_swa =     2",
        "\n00000000",
        "\n8    9    2    3    4    5    6    7    ",
        "find_slot: stream[0] min[0] =     2, max[0] =     9",
        "apply_ubatch: purging positions [2, 8] of sequence 0 from KV cache",
    ]


def test_purge_lines_for_seqs_whose_every_cell_was_taken(debug_log):
    """llama.cpp purges when seq_pos_min(q) <= the overwritten max, and an absent seq has min -1: seq 2
    takes every cell of seqs 1 and 0 (chunk 0-3 is masked for their next position 4), so the lines read
    [-1, 3] and remove nothing. They come in ascending seq order (seq 1's cells are met first), and twice:
    the dry run restores the overwritten cells, so the real apply overwrites them again."""
    kv = cache(8, level=0, n_swa=4, swa_type=SwaType.CHUNKED)
    assert decode(kv, seq_run(1, 0, 3)) == 0
    assert decode(kv, seq_run(0, 0, 3)) == 0
    assert decode(kv, seq_run(2, 0, 7)) == 0
    assert messages(debug_log) == ["apply_ubatch: purging positions [-1, 3] of sequence 0 from KV cache",
                                   "apply_ubatch: purging positions [-1, 3] of sequence 1 from KV cache"] * 2
    assert (kv.seq_pos_min(0), kv.seq_pos_min(1), kv.seq_pos_max(2)) == (-1, -1, 7)


# ---- the setting -------------------------------------------------------------------------------------
def test_environment_variable_is_read_at_construction(monkeypatch):
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", " 2 ")
    kv = make_cache(ev.EventBus(), 8)
    assert kv.debug_level == 2
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "")
    assert make_cache(ev.EventBus(), 8).debug_level == 0
    monkeypatch.delenv("LLAMA_KV_CACHE_DEBUG")
    assert make_cache(ev.EventBus(), 8).debug_level == 0
    assert kv.debug_level == 2, "a cache keeps the level it was built with"


@pytest.mark.parametrize("value", ["abc", "2x", "1.5"])
def test_a_non_integer_environment_value_is_refused(monkeypatch, value):
    """llama.cpp's atoi would read these as 0, 2 and 1 without a word."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", value)
    with pytest.raises(ContextParamsError, match=rf"LLAMA_KV_CACHE_DEBUG='{value}' is not an integer"):
        make_cache(ev.EventBus(), 8)


def test_build_memory_gives_every_cache_the_level(monkeypatch):
    """An explicit kv_cache_debug wins over the environment, for both caches of an iSWA pair."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")
    cfg = tiny_config(n_swa=4, swa_type=int(SwaType.STANDARD), swa_layers=(True, False))
    params = SimpleNamespace(n_ctx_seq=8, n_stream=1, n_seq_max=1, type_k="f32", type_v="f32", v_trans=False,
                             pad=8, kv_unified=True, n_ubatch=8, swa_full=False)

    def levels(**kw):
        return [c.debug_level for c in build_memory(cfg, params, bus=ev.EventBus(), key_shifter=no_rope,
                                                    **kw).caches()]

    assert levels(kv_cache_debug=3) == [3, 3]
    assert levels(kv_cache_debug=0) == [0, 0]
    assert levels() == [1, 1]


def test_a_ubatch_larger_than_the_cache_is_an_error_line_at_any_level(caplog):
    """llama.cpp logs it with LLAMA_LOG_ERROR, debug dump or not."""
    caplog.set_level(logging.ERROR, logger="kvscope")
    memory = cache(8, level=0)
    assert decode(memory, seq_run(0, 0, 8)) == 1
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["find_slot: n_tokens = 9 > size = 8"]


def test_a_bad_environment_value_refuses_the_context_before_anything_is_reserved(monkeypatch):
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "lots")
    gpu = engine.placement.devices.virtual_device("VGPU0=64MiB")
    model = in_memory_model()
    with pytest.raises(ContextParamsError, match="LLAMA_KV_CACHE_DEBUG='lots' is not an integer"):
        engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=-1)
    assert gpu.reserved_bytes() == 0  # checked while the exception (and its frames) still live
    assert {d.name for d in model.transformer.weight_devices.devices()} == {"CPU"}
