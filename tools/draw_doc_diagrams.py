"""Draw the diagrams of docs/how-the-kv-cache-works.md with kvscope itself, so they show what the engine does.

Each diagram is a small scenario on the bundled demo model (engine.load_model("demo"), a 6-layer Gemma 3 with
five sliding-window layers and one full-attention layer) in a tiny cache (pad=16, a few dozen cells). The
cells are drawn from what a view draws: a Watcher subscribed to the context's event bus, its frames' owner
codes as llama.cpp-style cell maps (engine.watch.describe.cell_map), and its mirror's positions, sequences and
pending shifts; every drawing is checked against the cache's own cells first. Tokens are fixed texts, never
sampled, so the diagrams are the same on every machine.

In the doc each diagram sits between `<!-- diagram: NAME -->` and `<!-- /diagram -->` as a fenced text block.

    python tools/draw_doc_diagrams.py            # rewrite the diagrams in the doc
    python tools/draw_doc_diagrams.py --check    # exit 1 if the doc differs from what would be written
    python tools/draw_doc_diagrams.py --print    # print the diagrams, change nothing
"""
from __future__ import annotations

import argparse
import difflib
import gc
import logging
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import engine  # noqa: E402
from engine import events as ev  # noqa: E402
from engine.kv import slot_debug  # noqa: E402
from engine.kv.types import CACHE_TYPES  # noqa: E402
from engine.runners.generate import context_shift  # noqa: E402
from engine.watch.describe import cell_map, describe_event  # noqa: E402
from engine.watch.visibility import CellVisibility, visibility  # noqa: E402
from engine.watch.watcher import Watcher  # noqa: E402

DOC = ROOT / "docs" / "how-the-kv-cache-works.md"
BLOCK = re.compile(r"(<!-- diagram: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /diagram -->)", re.S)
COL = 3  # characters per cell in a drawn lane
MiB = 2**20

# Fixed texts (the demo model's tokenizer adds <bos> to a prompt)
MOSES = "And God said unto Moses"
GENESIS = "In the beginning God created the heaven and the earth."
LORD = "And the LORD spake unto Moses, saying, Speak unto the children of Israel"


# ---- a context and what a view of it draws ------------------------------------------------------------
class Scene:
    """A context on the demo model and a Watcher on its bus: decode fixed texts, run sequence operations,
    draw lanes from the watcher's frames (after checking them against the cache's own cells)."""

    def __init__(self, model, **settings) -> None:
        settings.setdefault("pad", 16)
        settings.setdefault("devices", [])  # no real GPU either: the same numbers on every machine
        self.model = model
        self.ctx = engine.Context(model, **settings)
        self.watcher = Watcher(self.ctx.bus.subscribe(), self.ctx.bus.current_state)
        self.watcher.poll()
        self.seen = self.watcher.events

    # -- driving it
    def tokens(self, text: str, bos: bool = True) -> list[int]:
        return self.model.tokenizer.encode(text, add_bos=bos)

    def decode(self, parts: list[tuple[int, list[int]]], n_pos: dict[int, int] | None = None) -> int:
        """One batch: for each (seq, tokens) the tokens at that sequence's next positions, in this order."""
        tokens, pos, seqs = [], [], []
        for seq, toks in parts:
            start = self.next_pos(seq) if n_pos is None else n_pos[seq]
            tokens += toks
            pos += range(start, start + len(toks))
            seqs += [[seq]] * len(toks)
        rc = self.ctx.decode(engine.Batch(tokens=tokens, pos=pos, seq_ids=seqs))
        self.watcher.poll()
        return rc

    def next_pos(self, seq: int) -> int:
        return self.ctx.memory.seq_pos_max(seq) + 1

    def new_events(self) -> list[ev.Event]:
        """The events since the previous call, as the event log lists them."""
        self.watcher.poll()
        events = self.watcher.events_since(self.seen)
        self.seen = self.watcher.events
        return events

    def log_lines(self, kinds: tuple[type, ...] = (ev.CellsChanged, ev.SlotSearchFailed, ev.StreamCopyExecuted)
                  ) -> list[str]:
        """The new events of some kinds, one line each as both explorers' event logs print them."""
        return [describe_event(e) for e in self.new_events() if isinstance(e, kinds)]

    # -- drawing it
    def caches(self) -> dict[str, object]:
        mem = self.ctx.memory
        return {c.name: c for c in mem.caches()}

    def lane(self, cache: str, stream: int = 0, *, title: str | None = None, cells: int | None = None,
             rows: tuple[str, ...] = ("seq", "pos", "shift"), marks: dict[str, list[str]] | None = None) -> list[str]:
        """One stream as a few rows of text: cell index, the llama.cpp map glyph ('.', the sequence id, 'M'),
        position, pending shift (only when some cell has one), the head; extra `marks` rows (name -> one
        character per cell) are added below."""
        self.watcher.poll()
        sf = self.watcher.frame().stream(cache, stream)
        mirror_cells = self.watcher.mirror.cells(stream, cache)
        engine_cells = self.caches()[cache].cells(stream)
        assert mirror_cells == engine_cells, f"{cache} stream {stream}: the watcher's cells differ from the cache's"
        n = sf.size if cells is None else cells
        glyphs = cell_map(sf.owner, per_line=sf.size)[0]
        out = [title if title is not None else self.lane_title(cache, stream)]
        out.append("  cell  " + "".join(f"{i:<{COL}}" for i in range(n)) + ("..." if n < sf.size else ""))
        for row in rows:
            if row == "seq":
                out.append("  seq   " + "".join(f"{g:<{COL}}" for g in glyphs[:n]))
            elif row == "pos":
                out.append("  pos   " + "".join(f"{p if p >= 0 else '.':<{COL}}" for p in sf.pos[:n].tolist()))
            elif row == "shift" and sf.shift[:n].any():
                out.append("  shift " + "".join(f"{f'{s:+d}' if s else '.':<{COL}}" for s in sf.shift[:n].tolist()))
        for name, chars in (marks or {}).items():
            out.append(f"  {name:<5} " + "".join(f"{c:<{COL}}" for c in chars[:n]))
        head = sf.head
        if head < n:
            out.append("        " + " " * (COL * head) + "^ head")
        else:
            out.append(f"        head = {head}" + (" (one past the last cell)" if head == sf.size else ""))
        shared = shared_runs(mirror_cells[:n])
        if shared:
            out.append("  M = " + ", ".join(f"cell{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''} {fmt_set(s)}"
                                            for a, b, s in shared))
        return out

    def lane_title(self, cache: str, stream: int = 0) -> str:
        c = self.caches()[cache]
        lo = c.layout
        window = f"sliding window {lo.n_swa}" if lo.n_swa else "full attention"
        layers = f"layer{'s' if len(lo.layer_ids) > 1 else ''} {span(lo.layer_ids)}"
        streams = f", stream {stream} of {c.n_stream}" if c.n_stream > 1 else ""
        return (f"{cache} cache ({window}, {layers}){streams}: {c.size} cells, used {c.used(stream)}")

    def same_cells(self, a: str, b: str) -> bool:
        ca, cb = self.caches()[a], self.caches()[b]
        return all(ca.cells(s) == cb.cells(s) and ca.head(s) == cb.head(s) for s in range(ca.n_stream))

    def close(self) -> None:
        self.watcher.subscription.close()
        placed = self.ctx.gpus
        del self.ctx
        if placed:
            gc.collect()  # the weights go back to the CPU before the next context places them anew


VIS_GLYPH = {CellVisibility.EMPTY: ".", CellVisibility.OTHER: "-", CellVisibility.ATTENDED: "+",
             CellVisibility.MASKED: "x", CellVisibility.FUTURE: ">"}


def sees(sc: Scene, seq: int, cache: str) -> list[str]:
    """One glyph per cell: what the next token of seq attends to in that cache (engine.watch.visibility, the
    kernel's own rule, as the `w` overlay and SwaWindow show it)."""
    codes = visibility(sc.watcher.mirror, seq).caches[cache].codes.tolist()
    return [VIS_GLYPH[CellVisibility(c)] for c in codes]


def same_line(sc: Scene) -> str:
    return "swa cache: " + ("the same cells, shifts and head" if sc.same_cells("base", "swa") else "NOT the same")


def shared_runs(cells) -> list[tuple[int, int, frozenset[int]]]:
    """Runs of consecutive cells holding the same set of several sequences: (first, last, seqs)."""
    runs: list[tuple[int, int, frozenset[int]]] = []
    for i, (_, seqs, _) in enumerate(cells):
        if len(seqs) < 2:
            continue
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == seqs:
            runs[-1] = (runs[-1][0], i, seqs)
        else:
            runs.append((i, i, seqs))
    return runs


def fmt_set(seqs) -> str:
    return "{" + ", ".join(str(s) for s in sorted(seqs)) + "}"


def span(ids) -> str:
    """Layer ids as a reader writes them: "5", "0-4", or "0, 2, 4"."""
    ids = list(ids)
    if len(ids) == 1:
        return str(ids[0])
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def piece(model, token: int) -> str:
    return repr(model.tokenizer.decode([token]))


def kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


def mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB"


# ---- the diagrams ------------------------------------------------------------------------------------------
def d_prefill(model) -> list[str]:
    sc = Scene(model, n_ctx=16)
    toks = sc.tokens(MOSES)
    rc = sc.decode([(0, toks)])
    base, swa = sc.caches()["base"], sc.caches()["swa"]
    out = [f'ctx = engine.Context(model, n_ctx=16, pad=16); decode "{MOSES}" as seq 0 at pos 0-{len(toks) - 1}'
           f" -> rc {rc}", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    out.append("")
    out.append(sc.lane_title("swa") + (": the same cells" if sc.same_cells("base", "swa") else ""))
    out.append("")
    out.append("each cell as the explorers' inspector tells it (from the events):")
    for i in range(len(toks)):
        out.append(f"  cell {i}: {sc.watcher.history.lines('base', 0, i)[0]}")
    per_layer = base.layout.type_k.row_bytes(base.layout.n_embd_k) + base.layout.type_v.row_bytes(base.layout.n_embd_v)
    out.append("")
    out.append(f"  one cell = a K row and a V row of {base.layout.n_embd_k} values ({base.layout.n_head_kv} KV head x "
               f"{base.layout.head_dim}) per layer, {base.layout.type_k.name}: {per_layer} bytes per layer;")
    out.append(f"  a base cell holds layer {span(base.layout.layer_ids)} ({per_layer} B), a swa cell layers "
               f"{span(swa.layout.layer_ids)} ({per_layer * len(swa.layout.layer_ids)} B)")
    out.append("")
    out.append("what the next slot search would print with LLAMA_KV_CACHE_DEBUG=3 (base cache):")
    for msg in slot_debug.stream_dump(base.v_cells[0], stream=0, head=base.head(0), size=base.size,
                                      n_swa=base.layout.n_swa, level=3):
        out += [line for line in msg.split("\n") if line.strip()]
    sc.close()
    return out


def d_shared_prefix(model) -> list[str]:
    sc = Scene(model, n_ctx=16, n_seq_max=2, kv_unified=True)
    prompt = sc.tokens("And God said")
    sc.decode([(0, prompt)])
    sc.ctx.memory.seq_cp(0, 1, -1, -1)
    sc.new_events()
    out = [f'decode "And God said" as seq 0 ({len(prompt)} tokens), then memory.seq_cp(0, 1, -1, -1):', ""]
    out += sc.lane("base", rows=("seq", "pos"))
    out.append("")
    a, b = sc.tokens(" unto", bos=False), sc.tokens(" to", bos=False)
    c, d = sc.tokens(" Moses", bos=False), sc.tokens(" Aaron", bos=False)
    sc.decode([(0, a), (1, b)])
    sc.decode([(0, c), (1, d)])
    out.append(f"then two decodes of one token per sequence: seq 0 {piece(model, a[0])} {piece(model, c[0])}, "
               f"seq 1 {piece(model, b[0])} {piece(model, d[0])}")
    out.append("")
    marks = {f"sees{s}": sees(sc, s, "base") for s in (0, 1)}
    out += sc.lane("base", rows=("seq", "pos"), marks=marks)
    out.append(f"  seqN: what the next token of seq N (pos {sc.next_pos(0)}) attends to: + seen, - another "
               "sequence's cell, . empty")
    sc.close()
    return out


def d_streams(model) -> list[str]:
    out = []
    for unified in (True, False):
        sc = Scene(model, n_ctx=32, n_seq_max=2, kv_unified=unified)
        p0, p1 = sc.tokens("And God said"), sc.tokens("Let there be light")
        sc.decode([(0, p0), (1, p1)])
        p = sc.ctx.params
        out.append(f"kv_unified={unified}: n_ctx {p.n_ctx}, {p.n_stream} stream{'s' if p.n_stream > 1 else ''} of "
                   f"{p.n_ctx_seq} cells; one batch: seq 0 \"And God said\", seq 1 \"Let there be light\"")
        for s in range(p.n_stream):
            out += sc.lane("base", s, title=f"base cache, stream {s}: {sc.ctx.memory.base.size} cells, used "
                                            f"{sc.ctx.memory.base.used(s)}", rows=("seq", "pos"))
        out.append("")
        sc.close()
    return out[:-1]


def d_hole(model) -> list[str]:
    sc = Scene(model, n_ctx=16, n_seq_max=3, kv_unified=True)
    sc.decode([(0, sc.tokens("And God said"))])
    sc.decode([(1, sc.tokens("Let there be light"))])
    sc.decode([(0, sc.tokens(" unto", bos=False)), (1, sc.tokens(" and", bos=False))])
    out = ['seq 0 "And God said", then seq 1 "Let there be light", then one token each:', ""]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.new_events()
    sc.ctx.memory.seq_rm(1, -1, -1)
    out += ["", "memory.seq_rm(1, -1, -1): seq 1 leaves its cells; the head moves back to the first freed cell", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.new_events()
    new = sc.tokens(GENESIS)[:6]
    rc = sc.decode([(2, new)])
    out += ["", f"decode 6 tokens of seq 2 -> rc {rc}: the slot search scans from the head and takes the first 6 "
                "free cells", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    out += [""] + ["  event: " + line for line in sc.log_lines((ev.CellsAllocated,))
                   if "(dry run)" not in line and line.startswith("CellsAllocated base")]
    sc.close()
    return out


def d_no_slot(model) -> list[str]:
    sc = Scene(model, n_ctx=16, n_ubatch=2, n_seq_max=2, kv_unified=True)
    toks = sc.tokens(LORD)[:13]
    sc.decode([(0, toks)])
    out = ["n_ctx=16, n_ubatch=2: seq 0 holds 13 cells; then a batch of 4 tokens for seq 1 (two ubatches of 2)", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.new_events()
    rc = sc.decode([(1, sc.tokens("Let there be"))])
    out += ["", f"decode -> rc {rc} ({sc.ctx.last_error})", "event log of that decode (the base cache):"]
    out.append("  split 1 (simple split):")
    rolled_back = False
    for line in sc.log_lines((ev.CellsChanged, ev.SlotSearchFailed)):
        if " base " not in line:
            continue
        if rolled_back:
            out.append("  split 2 (equal split: the iSWA pair tries once more), the same two ubatches here:")
        rolled_back = line.startswith("SlotsRolledBack")
        out.append("    " + line)
    out += ["", "after it: nothing changed"]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.close()
    return out


def d_seq_ops(model) -> list[str]:
    sc = Scene(model, n_ctx=16, n_seq_max=3, kv_unified=True)
    mem = sc.ctx.memory
    sc.decode([(0, sc.tokens(LORD)[:6])])
    sc.decode([(2, sc.tokens(" unto Moses", bos=False))], n_pos={2: 0})
    sc.new_events()
    out = ["seq 0 at pos 0-5, seq 2 at pos 0-1 (the first 10 of 16 cells of the base cache):"]
    steps: list[tuple[str, Callable[[], object]]] = [
        ("seq_cp(0, 1, -1, -1)   seq 1 shares every cell of seq 0: no K/V is copied", lambda: mem.seq_cp(0, 1, -1, -1)),
        ("seq_rm(0, 4, -1)       seq 0 leaves pos 4 and up; cells 4, 5 stay, held by seq 1", lambda: mem.seq_rm(0, 4, -1)),
        ("seq_keep(1)            cells without seq 1 are freed, the others hold only seq 1", lambda: mem.seq_keep(1)),
        ("seq_add(1, 4, -1, +2)  pos 4, 5 of seq 1 become 6, 7: a pending shift of +2; the head goes to 0",
         lambda: mem.seq_add(1, 4, -1, 2)),
        ("decode seq 1 at pos 8  the K-shift runs first (shifts cleared), then the token takes the first free cell",
         lambda: sc.decode([(1, sc.tokens(" Israel", bos=False))])),
        ("seq_div(1, 0, 4, 2)    pos 0-3 become 0, 0, 1, 1; the shift is old - new (seq_add would record new - old)",
         lambda: mem.seq_div(1, 0, 4, 2)),
    ]
    out += sc.lane("base", title="", cells=10)[1:]
    for text, call in steps:
        call()
        out += ["", text]
        out += sc.lane("base", title="", cells=10)[1:]
        kinds = (ev.CellsChanged, ev.SlotSearchFailed)
        out += [f"  event: {line}" for line in sc.log_lines(kinds) if " base " in line and "(dry run)" not in line]
    sc.close()
    return out


def d_context_shift(model) -> list[str]:
    sc = Scene(model, n_ctx=16)
    toks = sc.tokens(LORD)[:16]
    sc.decode([(0, toks)])
    out = ["seq 0 fills all 16 cells (pos 0-15); the next token has no room", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.new_events()
    shift = context_shift(sc.ctx, 0, n_past=16, n_keep=4)
    out += ["", f"context shift (llama-completion's): n_keep = {shift.n_keep}, n_left = {shift.n_left}, "
                f"n_discard = {shift.n_discard}",
            f"  seq_rm(0, {shift.n_keep}, {shift.n_keep + shift.n_discard}); "
            f"seq_add(0, {shift.n_keep + shift.n_discard}, 16, {-shift.n_discard})", ""]
    out += sc.lane("base")
    out.append(same_line(sc))
    out += [f"  event: {line}" for line in sc.log_lines()]
    nxt = sc.tokens(" Israel", bos=False)
    rc = sc.decode([(0, nxt)])
    out += ["", f"next decode (pos {sc.next_pos(0) - 1}) -> rc {rc}: first the K-shift re-rotates the keys of the "
                f"moved cells, then the token takes the first free cell", ""]
    out += sc.lane("base")
    out.append(same_line(sc))
    out += [f"  event: {line}" for line in sc.log_lines((ev.KShiftApplied, ev.CellsAllocated)) if "(dry run)" not in line]
    for cell in (4, 10):
        out.append(f"  cell {cell} in the inspector, newest first:")
        out += [f"    {line}" for line in sc.watcher.history.lines("base", 0, cell)]
    sc.close()
    return out


def d_swa(model) -> list[str]:
    sc = Scene(model, n_ctx=32, n_ubatch=8, swa_window=8)
    toks = sc.tokens(LORD)[:16] + sc.tokens(GENESIS, bos=False)[:8]
    rc = sc.decode([(0, toks)])
    vis = visibility(sc.watcher.mirror, 0)
    out = [f"swa_window=8, n_ctx=32, n_ubatch=8: seq 0 decodes pos 0-{len(toks) - 1} in one batch (three ubatches)"
           f" -> rc {rc}", f"'sees': what its next token (pos {vis.next_pos}) attends to: + seen, x stored but masked", ""]
    for name in ("base", "swa"):
        out += sc.lane(name, rows=("seq", "pos"), marks={"sees": sees(sc, 0, name)})
        out.append(f"  {vis.caches[name].describe()}")
        out.append("")
    sc.new_events()
    rc = sc.decode([(0, sc.tokens(" God", bos=False))])
    lines = [line for line in sc.log_lines((ev.CellsAllocated,)) if "(dry run)" not in line]
    out.append(f"one more token (pos {sc.next_pos(0) - 1}) -> rc {rc}: base takes a free cell; swa reuses the "
               "first masked cell from its head")
    out += [f"  event: {line}" for line in lines]
    out.append(f"  seq_pos_min(0) = {sc.ctx.memory.seq_pos_min(0)} (answered by the swa cache), "
               f"base still holds pos {sc.ctx.memory.base.seq_pos_min(0)}-{sc.ctx.memory.base.seq_pos_max(0)}")
    sc.close()
    return out


def d_swa_sizes(model) -> list[str]:
    out = ["the demo model (5 sliding layers with a 64-token window, 1 full layer), pad 256, K and V f16:", "",
           f"{'settings':<34}{'base cells':>11}{'swa cells':>10}{'K+V':>11}  can shift"]
    for label, kw in (("-c 4096", {}), ("-c 4096 -ub 64", dict(n_ubatch=64)),
                      ("-c 4096 -np 4", dict(n_seq_max=4)), ("-c 4096 -np 4 -kvu", dict(n_seq_max=4, kv_unified=True)),
                      ("-c 4096 --swa-full", dict(swa_full=True))):
        sc = Scene(model, n_ctx=4096, pad=256, **kw)
        mem = sc.ctx.memory
        streams = f" x{mem.n_stream}" if mem.n_stream > 1 else ""
        out.append(f"{label:<34}{f'{mem.base.size}{streams}':>11}{f'{mem.swa.size}{streams}':>10}"
                   f"{mib(mem.k_bytes() + mem.v_bytes()):>11}  {'yes' if mem.can_shift() else 'no'}")
        sc.close()
    return out


def d_kv_types(model) -> list[str]:
    cfg = model.config
    row = cfg.n_head_kv * cfg.head_dim
    big = 8 * 128  # Llama 3 8B: 8 KV heads x 128, 32 layers
    out = ["bytes per cell = layers x (K row + V row); a row holds n_head_kv x head_dim values",
           f"demo model: 6 layers x {row} values; an 8B Llama-3-shaped model: 32 layers x {big} values", "",
           f"{'type':<8}{'block':>6}{'bytes/block':>12}{'row of 64':>10}{'demo cell':>11}{'8B cell':>11}  block layout"]
    layouts = {"f32": "one f32 per value", "f16": "one f16 per value", "bf16": "one bf16 per value",
               "q8_0": "f16 scale d, 32 x int8", "q4_0": "f16 d, 32 x 4-bit (16 B)",
               "q4_1": "f16 d, f16 min m, 32 x 4-bit", "iq4_nl": "f16 d, 32 x 4-bit index into a table",
               "q5_0": "f16 d, 32 high bits (4 B), 32 x 4-bit", "q5_1": "f16 d, f16 m, 4 B high bits, 32 x 4-bit"}
    for name, t in CACHE_TYPES.items():
        demo = cfg.n_layer * 2 * t.row_bytes(row)
        llama = 32 * 2 * t.row_bytes(big)
        out.append(f"{name:<8}{t.block_size:>6}{t.block_bytes:>12}{t.row_bytes(64):>10}{demo:>11}{kib(llama):>11}"
                   f"  {layouts[name]}")
    out += ["", "llama.cpp's init lines of the demo model at -c 256 (one per cache):"]
    for tk, tv in (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")):
        sc = Scene(model, n_ctx=256, pad=256, type_k=tk, type_v=tv)
        out += [f"  {line}" for line in sc.ctx.init_log_lines if "llama_kv_cache: size" in line]
        sc.close()
    return out


def d_offload(model) -> list[str]:
    out = ["the demo model at -c 4096 on virtual GPUs of 64 MiB; L0-L5 are its layers, out the output layer",
           "(compute buffers are left out: their bound depends on the machine's thread count)", ""]
    configs = (("-ngl 0", dict(devices=["VGPU0=64MiB"], n_gpu_layers=0)),
               ("-ngl 4", dict(devices=["VGPU0=64MiB"], n_gpu_layers=4)),
               ("-ngl 4 -nkvo", dict(devices=["VGPU0=64MiB"], n_gpu_layers=4, offload_kqv=False)),
               ("-ngl all -ts 1,1", dict(devices=["VGPU0=64MiB", "VGPU1=64MiB"], n_gpu_layers=-1,
                                         tensor_split=[1, 1])))
    for label, kw in configs:
        sc = Scene(model, n_ctx=4096, pad=256, **kw)
        layers = sc.watcher.mirror.devices.layer_map()
        p = sc.ctx.placement
        out.append(label)
        out.append("  weights " + " ".join(f"L{lp.layer}:{lp.device}" for lp in layers) + f" out:{p.output_device.name}")
        out.append("  K/V     " + " ".join(f"L{lp.layer}:{lp.kv_device}" for lp in layers))
        for row in sorted(sc.watcher.mirror.devices.rows.values(), key=lambda r: r.label):
            b = row.bytes
            out.append(f"  {row.label:<16} weights {mib(b['weights']):>10}   K/V {mib(b['kv']):>9}")
        out.append("")
        sc.close()
    return out[:-1]


def d_state(model) -> list[str]:
    sc = Scene(model, n_ctx=16, n_seq_max=3, kv_unified=True)
    sc.decode([(0, sc.tokens("And God said"))])
    sc.decode([(1, sc.tokens("Let there be light"))])
    sc.decode([(2, sc.tokens(" unto Moses", bos=False))], n_pos={2: 0})
    sc.ctx.memory.seq_rm(1, -1, -1)
    sc.watcher.poll()
    out = ["three sequences, then seq_rm(1, -1, -1): a hole in the middle", ""]
    out += sc.lane("base", rows=("seq", "pos"))
    whole = sc.ctx.state_get_data()
    one = sc.ctx.state_seq_get_data(2)
    out += ["", f"state_get_data(): {len(whole)} bytes (every cell of both caches); "
                f"state_seq_get_data(2): {len(one)} bytes (seq 2's cells)", ""]
    sc.ctx.memory.clear()
    sc.ctx.state_set_data(whole)
    sc.watcher.poll()
    out.append("state_set_data(whole) on the cleared cache: the cells come back packed from cell 0")
    out += sc.lane("base", rows=("seq", "pos"))
    sc.ctx.state_seq_set_data(one, 1)
    sc.watcher.poll()
    out += ["", "state_seq_set_data(seq 2's state, dest 1): placed by a slot search, as a decode places tokens"]
    out += sc.lane("base", rows=("seq", "pos"))
    sc.close()
    return out


DIAGRAMS: dict[str, Callable[[object], list[str]]] = {
    "prefill": d_prefill,
    "shared-prefix": d_shared_prefix,
    "streams": d_streams,
    "hole": d_hole,
    "no-slot": d_no_slot,
    "seq-ops": d_seq_ops,
    "context-shift": d_context_shift,
    "swa": d_swa,
    "swa-sizes": d_swa_sizes,
    "kv-types": d_kv_types,
    "offload": d_offload,
    "state": d_state,
}


# ---- the doc -----------------------------------------------------------------------------------------------
def render(names: list[str] | None = None) -> dict[str, str]:
    """Every diagram's text (a fenced block), by name."""
    logger = logging.getLogger("kvscope")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.CRITICAL)  # llama.cpp's log lines: the diagrams quote those they need
    torch.set_num_threads(1)  # tiny tensors: threads only cost time, most of all on a busy machine
    try:
        model = engine.load_model("demo")
        out = {}
        for name, draw in DIAGRAMS.items():
            if names is None or name in names:
                lines = [line.rstrip() for line in draw(model)]
                out[name] = "```text\n" + "\n".join(lines) + "\n```\n"
        return out
    finally:
        logger.setLevel(level)
        torch.set_num_threads(threads)


def rewrite(text: str, diagrams: dict[str, str]) -> str:
    """The doc with every diagram block's body replaced; every block must have a diagram and every
    diagram a block."""
    found = [m.group("name") for m in BLOCK.finditer(text)]
    missing = sorted(set(diagrams) - set(found))
    unknown = sorted(set(found) - set(DIAGRAMS))
    if missing or unknown:
        raise SystemExit(f"{DOC.name}: diagrams without a block: {missing}; blocks without a diagram: {unknown}")
    return BLOCK.sub(lambda m: m.group(1) + diagrams[m.group("name")] + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc differs from what would be written")
    parser.add_argument("--print", action="store_true", help="print the diagrams; change nothing")
    parser.add_argument("names", nargs="*", help="only these diagrams (--print only)")
    args = parser.parse_args(argv)
    if args.names and not args.print:
        parser.error("naming diagrams is for --print")
    diagrams = render(args.names or None)
    if args.print:
        for name, body in diagrams.items():
            print(f"<!-- diagram: {name} -->\n{body}")
        return 0
    old = DOC.read_text(encoding="utf-8")
    new = rewrite(old, diagrams)
    if args.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(DOC),
                                                       "drawn by kvscope now"))
            print(f"\n{DOC.relative_to(ROOT)} differs from what the engine draws: run python tools/draw_doc_diagrams.py")
            return 1
        return 0
    if new != old:
        DOC.write_text(new, encoding="utf-8")
        print(f"rewrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
