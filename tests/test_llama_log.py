"""engine/watch/llama_log: llama.cpp's own log read into the engine's events.

The fixtures (tests/data/llama-cpp-logs/) are real llama.cpp 0c1e570 logs. The check at every dump is the
strongest one the text allows: the parser's picture of the stream, written out again with kvscope's own
writer of the dump (engine/kv/slot_debug.py, byte-identical to llama.cpp's), gives the dump's text back."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest

from engine import events as ev
from engine.kv import slot_debug
from engine.kv.cells import KVCells
from engine.watch.llama_log import LlamaLogParser
from engine.watch.llama_log.lines import LineSplitter
from engine.watch.mirror import CacheMirror

LOGS = Path(__file__).parent / "data" / "llama-cpp-logs"
RAW_LOGS = ["llama-cpp-kv-debug3-unified.log", "llama-cpp-kv-debug3-split.log", "llama-cpp-kv-debug3-gemma3.log"]
ALL_LOGS = RAW_LOGS + ["llama-server-gemma3-swa-chat.log"]


def parse(data: str | bytes) -> tuple[LlamaLogParser, list[ev.Event], CacheMirror]:
    parser = LlamaLogParser()
    events = parser.feed(data) + parser.finish()
    mirror = CacheMirror()
    mirror.apply_all(events)
    return parser, events, mirror


def cells_of(mirror: CacheMirror, cache: str, stream: int) -> KVCells:
    st = mirror.caches[cache].streams[stream]
    cells = KVCells(len(st.pos))
    cells.pos[:] = st.pos
    cells.seq[:] = st.seq
    return cells


def dumps_in(text: str) -> list[dict]:
    """Each dump of a log, as its cleaned lines: where its summary starts (a character offset), the summary,
    the map rows, the position rows, the min/max lines."""
    found, offset = [], 0
    splitter = LineSplitter()
    lines = []
    for raw in text.splitlines(keepends=True):
        for line in splitter.feed(raw):
            lines.append((offset, line.text))
        offset += len(raw)
    current = None
    for at, line in lines:
        if line.startswith("find_slot: stream[") and ", n =" in line:
            current = {"at": at, "summary": line, "map": [], "pos": [], "minmax": []}
            found.append(current)
        elif current is None or not line:
            continue
        elif line.startswith("find_slot: stream[") and "min[" in line:
            current["minmax"].append(line)
        elif set(line.rstrip(" *")) <= set(".M0123456789") and not current["pos"] and "  " not in line:
            current["map"].append(line)
        elif set(line) <= set(".0123456789 *") and current["map"]:
            current["pos"].append(line)
        elif not splitter.prefixed_log:
            current = None  # another line: the dump is over
        # in a log of prefixed entries another thread's entry may come between two of the dump's (llama-server's
        # HTTP threads do): the dump goes on until the next one
    return found


def each_dump(text: str, parser: LlamaLogParser):
    """(number, dump, mirror) after feeding the log up to the start of the next dump (and idle(): a dump
    followed at once by the next one is complete only then)."""
    dumps, mirror, fed = dumps_in(text), CacheMirror(), 0
    for k, dump in enumerate(dumps):
        end = dumps[k + 1]["at"] if k + 1 < len(dumps) else len(text)
        mirror.apply_all(parser.feed(text[fed:end]) + parser.idle())
        fed = end
        yield k, dump, mirror


def rendered(mirror: CacheMirror, cache: str, stream: int, n_swa: int) -> dict:
    cells = cells_of(mirror, cache, stream)
    st = mirror.caches[cache].streams[stream]
    size = len(st.pos)
    return {"summary": slot_debug.summary_line(cells, stream=stream, head=st.head, size=size, n_swa=n_swa),
            "map": [r for r in slot_debug.cell_map(cells).split("\n") if r],
            "pos": [r for r in slot_debug.position_line(cells).split("\n") if r],
            "minmax": slot_debug.seq_min_max_lines(cells, stream=stream)}


@pytest.mark.parametrize("name", ALL_LOGS)
def test_every_dump_is_reproduced_by_the_parsed_cells(name):
    """Feed the log up to each dump's end: the mirror of the events, written as a dump, is that dump."""
    text = (LOGS / name).read_text()
    parser = LlamaLogParser()
    dumps = 0
    for k, dump, mirror in each_dump(text, parser):
        dumps += 1
        if not dump["map"]:
            continue
        stream = int(dump["summary"].split("[")[1].split("]")[0])
        n_swa = int(dump["summary"].rsplit("=", 1)[1])
        size = int(dump["summary"].split("size =")[1].split(",")[0])
        cache = next(name for name, c in mirror.caches.items()
                     if c.size == size and (name == "swa") == (n_swa > 0) and stream < len(c.streams))
        got = rendered(mirror, cache, stream, n_swa)
        want = {key: [r.rstrip() if key != "summary" else r for r in dump[key]] if key != "summary" else dump[key]
                for key in ("summary", "map", "pos", "minmax")}
        got["pos"] = [r.rstrip() for r in got["pos"]]
        assert got == want, f"dump {k} (line at offset {dump['at']}) of {name}"
    assert dumps >= 24 and parser.stats.dumps_damaged == 0


def test_contexts_and_caches_from_the_init_lines():
    _, events, mirror = parse((LOGS / "llama-cpp-kv-debug3-unified.log").read_bytes())
    created = [e for e in events if isinstance(e, ev.ContextCreated)]
    assert [(c.cache, c.kv_size, c.n_stream, c.n_seq_max, c.type_k, c.unified, c.layer_ids, c.n_ctx)
            for c in created] == [("kv", 256, 1, 3, "f32", True, (0, 1, 2, 3), 256)]
    assert created[0].model_name == "tiny-llama-oracle"
    assert any("llama_kv_cache: size =" in line for line in created[0].log_lines)

    _, events, mirror = parse((LOGS / "llama-cpp-kv-debug3-split.log").read_bytes())
    assert mirror.created["kv"].n_stream == 3 and not mirror.created["kv"].unified

    _, events, mirror = parse((LOGS / "llama-cpp-kv-debug3-gemma3.log").read_bytes())
    base, swa = mirror.created["base"], mirror.created["swa"]
    assert (base.kv_size, base.layer_ids, base.n_swa) == (512, (5,), 0)
    assert (swa.kv_size, swa.layer_ids, swa.n_swa, swa.swa_type) == (256, (0, 1, 2, 3, 4), 16, 1)


def test_the_server_log_gives_the_server_simulations_events():
    """The four requests of the fixture's README, as the slot lines tell them."""
    parser, events, mirror = parse((LOGS / "llama-server-gemma3-swa-chat.log").read_bytes())
    assert parser.program == "llama-server"
    started = [(e.slot, e.task, e.selected_by, e.n_prompt) for e in events if isinstance(e, ev.ServerTaskStarted)]
    assert started == [(0, 0, "id", 270), (0, 14, "id", 350), (1, 22, "id", 150), (0, 32, "id", 70)]
    reused = [(e.task, e.n_kept, e.n_common, e.n_past, e.forced_full, e.pos_min_thold)
              for e in events if isinstance(e, ev.ServerPromptReused)]
    assert reused == [(0, 0, 0, 0, False, -1), (14, 273, 270, 270, False, -1), (22, 0, 0, 0, False, -1),
                      (32, 353, 40, 0, True, 24)]
    finished = [(e.task, e.n_processed, e.n_generated, e.stop, e.n_kept) for e in events
                if isinstance(e, ev.ServerTaskFinished)]
    assert finished == [(0, 270, 4, "limit", 273), (14, 80, 4, "limit", 353), (22, 150, 4, "limit", 153),
                        (32, 70, 4, "limit", 73)]
    checkpoints = [(e.slot, e.action, e.n_tokens, e.why) for e in events if isinstance(e, ev.CheckpointChanged)]
    assert checkpoints[:2] == [(0, "created", 238, ""), (0, "created", 266, "")]
    assert [c for c in checkpoints if c[1] == "erased"] == [(0, "erased", n, "invalidated") for n in (238, 266, 318, 346)]
    # the removal the forced re-processing made is said in the server's words, not as "seen at the slot search"
    causes = {e.cause for e in events if isinstance(e, ev.CellsSeen)}
    assert "memory_seq_rm [0, end) of slot 0, task 32" in causes
    # two contexts: the one --fit measured, then the real one; two streams of each cache of the iSWA pair
    assert sum(isinstance(e, ev.ContextCreated) for e in events) == 4
    assert [len(mirror.caches[c].streams) for c in ("base", "swa")] == [2, 2]
    # the devices' memory from the buffer lines
    memory = [e for e in events if isinstance(e, ev.DeviceMemoryState)][-1]
    cpu = next(d for d in memory.devices if d.device == "CPU")
    assert (cpu.weights, cpu.kv) == (round(3.89 * 2**20), round(0.25 * 2**20) + round(0.62 * 2**20))
    # the server's host memory: the checkpoints its slots hold (2 + 2 of 0.020 MiB at the end) and its prompt
    # cache (its last "cache state: 2 prompts, 0.288 MiB")
    assert (cpu.checkpoints, cpu.prompt_cache) == (4 * round(0.020 * 2**20), round(0.288 * 2**20))
    during = [next(d for d in e.devices if d.device == "CPU").checkpoints for e in events
              if isinstance(e, ev.DeviceMemoryState)]
    assert max(during) == 4 * round(0.020 * 2**20) + 2 * round(0.020 * 2**20)  # slot 0's four, slot 1's two


def test_a_log_fed_byte_by_byte_gives_the_same_events():
    data = (LOGS / "llama-cpp-kv-debug3-unified.log").read_bytes()
    _, whole, _ = parse(data)
    parser = LlamaLogParser()
    pieces = []
    for i in range(len(data)):
        pieces += parser.feed(data[i:i + 1])
    pieces += parser.finish()
    assert [describe(e) for e in pieces] == [describe(e) for e in whole]


def describe(event: ev.Event) -> tuple:
    if isinstance(event, ev.CellsChanged):
        return (event.kind, event.cause, *[(c.stream, c.cells.tolist(), c.pos.tolist(), c.seq_bits.tolist(), c.head)
                                           for c in event.changes])
    return (event.kind,)


def test_a_log_cut_anywhere_never_breaks_the_parser():
    """A cut at every byte of the first slot searches (both caches of the iSWA pair: summaries, maps,
    positions, min/max lines), and at every 997th byte of the whole log: the parser reads what is there."""
    data = (LOGS / "llama-cpp-kv-debug3-gemma3.log").read_bytes()
    start = data.index(b"find_slot")
    region_end = data.index(b"=== decode pos 32")
    # the init lines the caches come from, without the model loader's hundreds of others
    init = b"".join(line for line in data[:start].splitlines(keepends=True)
                    if line.startswith((b"llama_context", b"llama_kv_cache", b"print_info: n_swa")))
    for cut in range(start, region_end):
        parser = LlamaLogParser()
        events = parser.feed(init) + parser.feed(data[start:cut]) + parser.finish()
        assert {e.cache for e in events if isinstance(e, ev.ContextCreated)} == {"base", "swa"}
        CacheMirror().apply_all(events)
    for cut in range(0, len(data), 997):
        parser = LlamaLogParser()
        CacheMirror().apply_all(parser.feed(data[:cut]) + parser.finish())
    assert region_end - start > 4000


def test_garbage_lines_between_entries_are_skipped_and_counted():
    text = (LOGS / "llama-cpp-kv-debug3-split.log").read_text()
    _, clean_events, clean = parse(text)
    rng = random.Random(7)
    garbage = ["\x00\x01binary\xff junk", "}}}{{{", "ŵ€ird ünïcode", "=" * 500, "12 34 !!", "  \t"]
    out, added, in_entry = [], 0, False
    for line in text.split("\n"):
        starts_entry = line.startswith(("find_slot", "llama_", "===", "    return")) or not line
        if starts_entry and not in_entry and rng.random() < 0.3:
            junk = rng.choice(garbage)
            out.append(junk)
            added += bool(junk.strip())
        out.append(line)
        in_entry = line.startswith("find_slot: stream[") and ", n =" in line
    parser, _, dirty = parse("\n".join(out))
    assert dirty.same_as(clean), dirty.differences(clean)
    assert parser.stats.dumps_damaged == 0 and parser.stats.dumps == 24
    base, _, _ = parse(text)
    assert parser.stats.skipped == base.stats.skipped + added


def test_windows_line_ends_colours_and_prefixes():
    text = (LOGS / "llama-cpp-kv-debug3-unified.log").read_text()
    _, _, plain = parse(text)
    _, _, crlf = parse(text.replace("\n", "\r\n").encode())
    assert crlf.same_as(plain), crlf.differences(plain)
    # common/log's prefix on every message's first line, colour codes around the level and the function
    prefixed, t = [], 0
    previous = ""

    def row(line: str) -> bool:
        return bool(line) and set(line.rstrip(" *")) <= set(".M0123456789 ")

    for line in text.split("\n"):
        # a message's lines after its first (a dump's rows, the newline that ends them) carry no prefix
        if row(line) or (not line and row(previous)):
            prefixed.append(line)
        else:
            t += 1
            prefixed.append(f"0.00.{t // 1000 % 1000:03d}.{t % 1000:03d} \x1b[34mD\x1b[0m {line}")
        previous = line
    _, _, coloured = parse("\n".join(prefixed))
    assert coloured.same_as(plain), coloured.differences(plain)


def test_a_line_without_its_end_waits_for_it():
    data = (LOGS / "llama-cpp-kv-debug3-unified.log").read_text()
    cut = data.index("find_slot: stream[0], n =     8") + 20
    parser = LlamaLogParser()
    parser.feed(data[:cut])
    assert parser.pending_chars == len("find_slot: stream[0]")
    _, whole, _ = parse(data)
    rest = parser.feed(data[cut:]) + parser.finish()
    assert sum(isinstance(e, ev.CellsSeen) for e in rest) > 0


def test_shared_cells_say_which_sequences_only_when_the_log_does():
    """Step 11 of the unified log puts one token in seqs 0 and 1 ('M'); steps 2 and 8 copy seq 0 to 1 and 2."""
    text = (LOGS / "llama-cpp-kv-debug3-unified.log").read_text()
    at = text.index("=== STEP 12")
    parser, mirror = LlamaLogParser(), CacheMirror()
    mirror.apply_all(parser.feed(text[:at]) + parser.idle())
    st = mirror.caches["kv"].streams[0]
    # the last dump before step 12: MMMM00MM102 at positions 0 0 1 1 4 5 4 5 6 6 2; seqs 0 (0..6), 1 (0..6), 2 (0..2)
    assert st.pos[:11].tolist() == [0, 0, 1, 1, 4, 5, 4, 5, 6, 6, 2]
    seqs = [sorted(s) for s in st.cells()[:11] for s in [s[1]]]
    # cells 0-3 hold positions 0 and 1, inside every seq's range: which of 0, 1, 2 share them is not in the log
    assert seqs[:4] == [[0, 1, 2]] * 4 and st.uncertain[:4].all()
    # cells 6 and 7 (positions 4, 5) are outside seq 2's range 0..2: exactly seqs 0 and 1
    assert seqs[6:8] == [[0, 1], [0, 1]] and not st.uncertain[6:8].any()
    assert seqs[4:6] == [[0], [0]] and seqs[8:11] == [[1], [0], [2]]
    # a fresh mirror from the parser's state has the same marks
    fresh = CacheMirror()
    fresh.apply_all(parser.state_events())
    assert fresh.same_as(mirror), fresh.differences(mirror)


# ---- kvscope's own LLAMA_KV_CACHE_DEBUG=3 output: the parser against the run's events ---------------------------
class DumpWitness(logging.Handler):
    """Collects the engine's debug messages as llama.cpp's text and, at each dump's summary, the cells the
    run's events had placed by then (dry-run placements included: the dump shows them)."""

    def __init__(self, bus: ev.EventBus) -> None:
        super().__init__(logging.DEBUG)
        self.sub = bus.subscribe(maxsize=1 << 20)
        self.state: dict[tuple[str, int], list] = {}
        self.text: list[str] = []
        self.truth: list[tuple[str, int, np.ndarray, np.ndarray]] = []  # per summary: cache, stream, pos, seq_bits

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.text.append(message + "\n")
        for event in self.sub.drain():
            if isinstance(event, ev.ContextCreated):
                for s in range(event.n_stream):
                    self.state[(event.cache, s)] = [np.full(event.kv_size, -1, dtype=np.int64),
                                                    np.zeros((event.kv_size, 32), dtype=np.uint8)]
            elif isinstance(event, ev.CellsChanged):
                for change in event.changes:
                    pos, bits = self.state[(event.cache, change.stream)]
                    pos[change.cells] = change.pos
                    bits[change.cells] = change.seq_bits
        if message.startswith("find_slot: stream[") and ", n =" in message:
            pos, bits = self.state[("kv", int(message.split("[")[1].split("]")[0]))]
            self.truth.append((pos.copy(), bits.copy()))


def test_kvscope_own_dump_parsed_gives_the_runs_cells(monkeypatch):
    """A run with 12 sequences in one stream (ids of one and two digits in the map, 'M' cells from seq_cp),
    positions of five digits (they touch in the position row) and a K-shift: at every dump, the parser's
    cells are the run's."""
    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    bus = ev.EventBus()
    witness = DumpWitness(bus)
    logger = logging.getLogger("kvscope")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(witness)
    try:
        ctx = engine.Context(in_memory_model(), n_ctx=512, n_seq_max=12, kv_unified=True, n_ubatch=16,
                             kv_cache_debug=3, bus=bus, type_k="f32", type_v="f32")
        def extend(seq: int, n: int) -> None:
            first = ctx.memory.seq_pos_max(seq) + 1
            assert ctx.decode(Batch([5] * n, list(range(first, first + n)), [[seq]] * n)) == 0

        ctx.decode(Batch(list(range(1, 9)), list(range(8)), [[0]] * 8))
        for s in range(1, 12):
            ctx.memory.seq_cp(0, s, 0, 4 if s % 2 else 8)
        for s in range(12):
            extend(s, 3 + s % 4)
        ctx.memory.seq_add(3, 0, -1, 10_000)  # five-digit positions: '%-5d' leaves no space between them
        extend(3, 2)
        extend(11, 20)  # two ubatches of one decode: the second's dump shows the first's placement
        ctx.memory.seq_rm(5, 0, -1)
        extend(10, 1)
        extend(10, 1)
    finally:
        logger.removeHandler(witness)
        logger.setLevel(old_level)
    text = "".join(witness.text)
    assert "10000" in text and "10" in text and "M" in text
    assert len(dumps_in(text)) == len(witness.truth) >= 18
    parser = LlamaLogParser()
    for k, dump, mirror in each_dump(text, parser):
        got = rendered(mirror, "kv", 0, 0)
        assert got["summary"] == dump["summary"]
        assert got["map"] == dump["map"] and got["pos"] == dump["pos"], f"dump {k}"
        # the cells against the run's events: positions, the sequences of every certain cell, and for an
        # uncertain one, possible sequences that include the true ones
        st = mirror.caches["kv"].streams[0]
        true_pos, true_bits = witness.truth[k]
        assert np.array_equal(st.pos, true_pos), f"dump {k}"
        certain = st.uncertain == 0 if st.uncertain is not None else np.ones(len(st.pos), dtype=bool)
        assert np.array_equal(st.seq_bits[certain], true_bits[certain]), f"dump {k}"
        assert np.array_equal(st.seq_bits[~certain] & true_bits[~certain], true_bits[~certain]), f"dump {k}"
    assert certain.sum() < len(certain)  # some shared cells stay open (seqs 0-11 all cover positions 0-3)
    assert parser.stats.dumps_damaged == 0 and parser.stats.skipped == 0


# ---- kvscope's server simulation writes llama-server's lines: read back, they give its own events ------------------
def test_the_server_simulations_log_read_back_gives_its_events():
    """The simulation (engine/runners/server/) writes its slot lines as llama-server does; the parser reading them
    gives the simulation's own server events, for every field the lines carry: the four requests of the
    fixture's chat, then a slot that fills up and shifts its context."""
    import random as rnd

    from engine.runners.server.server import Task
    from tests.test_server_sim import server, the_logged_chat

    model = gemma3_16_model()
    sims = [server(model), server(model, swa_full=True, context_shift=True)]
    the_logged_chat(sims[0])
    rng = rnd.Random(9)
    sims[1].submit(Task([rng.randrange(3, 500) for _ in range(500)], n_predict=20, id_slot=0, n_keep=10))
    sims[1].run()
    for sim in sims:
        parser = LlamaLogParser()
        events = parser.feed("\n".join(sim.log.lines) + "\n") + parser.finish()
        theirs = sim.finished
        finished = [e for e in events if isinstance(e, ev.ServerTaskFinished)]
        assert [(e.slot, e.task, e.n_prompt, e.n_cached, e.n_processed, e.n_generated, e.stop, e.n_kept) for e in finished] == [
            (e.slot, e.task, e.n_prompt, e.n_cached, e.n_processed, e.n_generated, e.stop, e.n_kept) for e in theirs]
        assert parser.stats.skipped == 0
    shifted = [e for e in events if isinstance(e, ev.ServerContextShifted)]
    assert [(e.slot, e.task, e.n_keep, e.n_left, e.n_discard) for e in shifted] == [(0, 0, 11, 500, 250)]
    started = [e for e in events if isinstance(e, ev.ServerTaskStarted)]
    assert [(e.slot, e.task, e.n_prompt, e.n_ctx_slot) for e in started] == [(0, 0, 500, 512)]


_GEMMA3_16 = []


def gemma3_16_model():
    """The model of tests/test_server_sim.py's gemma3_16 fixture (the shape behind the server fixture log)."""
    if not _GEMMA3_16:
        import tempfile

        import engine
        from engine.testing import write_hf_model

        folder = write_hf_model(Path(tempfile.mkdtemp()) / "gemma3-w16", "gemma3", n_layer=6, n_embd=128, n_head=4,
                                n_head_kv=2, n_ff=256, vocab_size=512, seed=2, rope_theta=1e6, n_ctx_train=512,
                                sliding_window=16)
        _GEMMA3_16.append(engine.load_model(folder))
    return _GEMMA3_16[0]


def test_a_map_of_ids_of_several_lengths_that_reads_two_ways_says_so():
    """Seqs 1, 2 and 12 over the same positions: "1212" over three held cells is 1 2 12 or 12 1 2. Each cell keeps
    the ids it may hold, marked as read two ways (not as shared); where the positions settle it, nothing is marked."""
    from engine.watch.llama_log.dumps import RawDump, decode

    def dump(labels: str, positions: list[int], ranges: dict) -> RawDump:
        raw = RawDump(stream=0, n=len(positions), used=len(positions), head=len(positions), size=256, n_swa=0)
        raw.map_rows = [labels + "." * (256 - len(positions)) + " *"]
        row = "".join(str(p).ljust(5) for p in positions) + ".    " * (256 - len(positions))
        raw.pos_rows = [row[i:i + 320] for i in range(0, 1280, 320)]
        raw.pos_rows[-1] += " *"
        raw.ranges = ranges
        return raw

    both = decode(dump("1212", [0, 1, 2], {1: (0, 5), 2: (0, 5), 12: (0, 5)}))
    held = [sorted(np.flatnonzero(np.unpackbits(both.seq_bits[c], bitorder="little")).tolist()) for c in range(3)]
    assert held == [[1, 12], [1, 2], [2, 12]]
    assert both.uncertain[:3].tolist() == [ev.SEQS_READ_TWO_WAYS] * 3
    # seq 12's range leaves out position 0: only 1 2 12 fits
    settled = decode(dump("1212", [0, 1, 2], {1: (0, 5), 2: (0, 5), 12: (2, 5)}))
    held = [np.flatnonzero(np.unpackbits(settled.seq_bits[c], bitorder="little")).tolist() for c in range(3)]
    assert held == [[1], [2], [12]] and not settled.uncertain.any()
