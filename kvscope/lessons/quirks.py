"""Notebook 8, the QUIRKs: each QUIRK's scenario on the demo model, and the checks that keep the notebook's
prose true, so that its cells show the QUIRK happen in a few lines.

A QUIRK is kvscope's name for a llama.cpp behaviour that looks unintended but that kvscope reproduces because
llama.cpp does it; the event carries it (`quirk`) and the explorers mark it with `!`.

Every scenario runs with the demo model's own sliding window, 64 positions (no swa_window): llama-server's
`pos_min >= pos_min_thold` QUIRK needs a window longer than a short chat, and one window serves the notebook.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

import engine
from engine import events as ev
from engine.kv.swa import SwaType, is_masked_swa
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.watch import Watcher, visibility
from engine.watch.describe import cell_map
from engine.watch.visibility import CellVisibility
from kvscope.lessons.debugging import scratch_folder

PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
           "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
           "the light from the darkness. And God called the light Day, and the darkness he called Night. And the "
           "evening and the morning were the first day. And God said, Let there be a firmament in the midst of the "
           "waters, and let it divide the waters from the waters. And God made the firmament, and divided the waters "
           "which were under the firmament from the waters which were above the firmament: and it was so. And God "
           "called the firmament Heaven. And the evening and the morning were the second day.")


def text_tokens(model, n: int, start: int = 0) -> list[int]:
    """n tokens of Genesis 1 from token `start` on (the passage read again when it runs out): text to decode."""
    tokens = model.tokenizer.encode(PASSAGE)
    while len(tokens) < start + n:
        tokens = tokens + tokens[1:]  # without a second BOS
    return tokens[start:start + n]


def context(model, **settings) -> tuple[engine.Context, Watcher]:
    """A context (pad 16: small caches) and a watcher that sees every event from its first."""
    ctx = engine.Context(model, **{"pad": 16, **settings})
    return ctx, Watcher.of(ctx.bus)


def decode(ctx: engine.Context, watcher: Watcher, seq: int, p0: int, n: int,
           all_logits: bool = False) -> tuple[int, list[ev.Event]]:
    """Decode n tokens of text for one sequence at positions p0, p0 + 1, ... in one batch (split into
    ubatches of n_ubatch); returns the return code and the events of this decode."""
    watcher.poll()
    mark = watcher.events
    rc = ctx.decode(engine.Batch.for_sequence(text_tokens(ctx.model, n, start=p0), seq, p0, all_logits=all_logits))
    watcher.poll()
    return rc, watcher.events_since(mark)


def marked(events: list[ev.Event]) -> list[ev.Event]:
    """The events that carry a QUIRK (what the explorers mark with `!`)."""
    return [e for e in events if getattr(e, "quirk", "")]


def quirk_log(watcher: Watcher, lines: int = 6):
    """The event log with its `quirks` filter on (it must have one to show)."""
    from explorer import EventLog

    log = EventLog(watcher, lines=lines)
    log.group.value = "quirks"
    assert log.kept(), "no QUIRK event to show"
    return log


def heads(ctx: engine.Context, cache: str = "base") -> list[int]:
    """Each stream's head: the cell where its next slot search starts."""
    memory = getattr(ctx.memory, cache)
    return [memory.head(s) for s in range(memory.n_stream)]


def heads_text(ctx: engine.Context, cache: str = "base") -> str:
    return ", ".join(f"stream {s} at cell {h}" for s, h in enumerate(heads(ctx, cache)))


def stream_maps(watcher: Watcher, cache: str) -> list[str]:
    """Each stream of `cache` as llama.cpp's LLAMA_KV_CACHE_DEBUG dump draws it: `.` empty, a digit the
    sequence, `M` several sequences."""
    return [f"{cache} stream {sf.stream}: {' '.join(cell_map(sf.owner))}" for sf in watcher.frame().streams
            if sf.cache == cache]


# ---- 1. the dry run's heads -------------------------------------------------------------------------------------
def rolled_back(events: list[ev.Event], cache: str = "base") -> ev.SlotsRolledBack:
    """The dry run's roll-back in `cache` (the last, when a decode rolled back several ubatches)."""
    return [e for e in events if isinstance(e, ev.SlotsRolledBack) and e.cache == cache][-1]


def head_after_rollback(rollback: ev.SlotsRolledBack, stream: int) -> int:
    return [c.head for c in rollback.changes if c.stream == stream][0]


# ---- 2. the dry run's SWA purge ---------------------------------------------------------------------------------
SYSTEM = 120  # tokens of the shared system prompt (section 2, the failed decode)
QUESTION = 80  # tokens client 1 sends


def purges(events: list[ev.Event]) -> list[ev.CellsRemoved]:
    """The SWA purges of the dry run (tentative: before anything is computed)."""
    return [e for e in events if isinstance(e, ev.CellsRemoved) and e.reason == "purge" and e.tentative]


def three_clients(model) -> tuple[engine.Context, Watcher]:
    """llama.cpp's `parallel` example in small: a system prompt decoded into sequence 0 and copied to clients 1
    and 2 with seq_cp (its cells then hold three sequences, which the slot search never reuses); client 1 asks a
    question. SWA cache: 64 x 3 + 16 = 208 cells, of which 8 are left free."""
    ctx, watcher = context(model, n_ctx=416, n_seq_max=3, kv_unified=True, n_ubatch=16)  # base: 2 x 208 cells
    assert decode(ctx, watcher, seq=0, p0=0, n=SYSTEM)[0] == 0
    for client in (1, 2):
        ctx.memory.seq_cp(0, client, -1, -1)
    assert decode(ctx, watcher, seq=1, p0=SYSTEM, n=QUESTION)[0] == 0
    assert ctx.memory.swa.size == 64 * 3 + 16 and ctx.memory.swa.seq_pos_min(1) == 0
    return ctx, watcher


def free_cells(ctx: engine.Context, cache: str = "swa") -> int:
    return sum(1 for pos, _, _ in getattr(ctx.memory, cache).cells(0) if pos < 0)


def window_of(ctx: engine.Context, pos: int) -> range:
    """The positions a token at `pos` sees in the sliding layers (is_masked_swa: standard window)."""
    n_swa = ctx.cache_config.n_swa
    return range(max(0, pos - n_swa + 1), pos + 1)


def check_purge_outlives_failure(ctx: engine.Context, rc: int, events: list[ev.Event], pos_min_before: int) -> None:
    """Client 2's first ubatch took cells of client 1 outside client 1's window, and purged client 1's older
    positions with them; the second ubatch found no cell, the decode returned 1, and the purge stayed: client 1's
    lowest position in the SWA cache moved, in its base cache not."""
    (purge,) = purges(events)
    assert rc == 1 and purge.seq_id == 1 and QUIRK_TEXT in purge.quirk
    assert any(isinstance(e, ev.SlotSearchFailed) for e in events)
    assert ctx.memory.swa.seq_pos_min(1) > pos_min_before == 0
    assert ctx.memory.base.seq_pos_min(1) == 0
    next_token = ctx.memory.seq_pos_max(1) + 1
    assert purge.p1 <= window_of(ctx, next_token).start  # in this example: outside client 1's next window


QUIRK_TEXT = "SWA purge of a dry run is not rolled back"
PROMPT, ASKED = 64, 56  # section 2, several ubatches: seq 0's prompt (shared with seq 1), then seq 1's own tokens


def shared_prompt(model, asked: int = ASKED) -> tuple[engine.Context, Watcher]:
    """Sequence 0's 64-token prompt copied to sequence 1 (shared cells), then `asked` tokens of sequence 1's own.
    SWA cache: 64 x 2 + 16 = 144 cells, 144 - 64 - asked of them free."""
    ctx, watcher = context(model, n_ctx=256, n_seq_max=2, kv_unified=True, n_ubatch=16)
    assert decode(ctx, watcher, seq=0, p0=0, n=PROMPT)[0] == 0
    ctx.memory.seq_cp(0, 1, -1, -1)
    assert decode(ctx, watcher, seq=1, p0=PROMPT, n=asked)[0] == 0
    assert ctx.memory.swa.size == 64 * 2 + 16 and free_cells(ctx) == 144 - PROMPT - asked
    return ctx, watcher


def full_cache_logits(model, n: int) -> list:
    """The logits of sequence 1's next n tokens on a cache that keeps every position (swa_full): the text's own."""
    ctx, watcher = context(model, n_ctx=256, n_seq_max=1, n_ubatch=16, swa_full=True)
    assert decode(ctx, watcher, seq=0, p0=0, n=PROMPT + ASKED)[0] == 0
    assert decode(ctx, watcher, seq=0, p0=PROMPT + ASKED, n=n, all_logits=True)[0] == 0
    return [ctx.logits(i) for i in range(n)]


def logit_gaps(ctx: engine.Context, reference: list) -> list[float]:
    """Per output token, the largest difference between its logits and the reference's."""
    return [float((ctx.logits(i) - r).abs().max()) for i, r in enumerate(reference)]


def purged_but_seen(ctx: engine.Context, purge: ev.CellsRemoved, first_ubatch: range) -> dict[int, list[int]]:
    """For each token of the first ubatch: the positions of its window that the dry run's purge removed from
    cells the roll-back does not restore (the shared prompt's cells: no ubatch took them)."""
    shared = range(0, PROMPT)
    lost = set(range(purge.p0, purge.p1)) & set(shared)
    return {p: sorted(lost & set(window_of(ctx, p))) for p in first_ubatch if lost & set(window_of(ctx, p))}


def positions_text(positions: list[int]) -> str:
    """A run of positions in words: "position 63" or "positions 57 to 63"."""
    if len(positions) == 1:
        return f"position {positions[0]}"
    return f"positions {positions[0]} to {positions[-1]}"


def check_seen_positions_purged(ctx: engine.Context, rc: int, events: list[ev.Event], gaps: list[float],
                                alone_gaps: list[float], seen: dict[int, list[int]], first: int) -> None:
    """The decode returns 0, one tentative purge of sequence 1 happened in the dry run, it removed positions the
    first ubatch's tokens see, and those tokens' logits are the furthest from the text's (the first ubatch decoded
    alone, with no later ubatch in its dry run, gives the text's own logits); later tokens differ far less, through
    the keys and values of those tokens."""
    (purge,) = purges(events)
    assert rc == 0 and purge.seq_id == 1 and purge.tentative
    assert seen and min(seen) == first and list(seen) == list(range(first, first + len(seen)))  # the first tokens
    assert max(alone_gaps) < 1e-3
    n_seen, n_ubatch = len(seen), ctx.params.n_ubatch
    assert min(gaps[:n_seen]) > 0.05
    assert np.mean(gaps[:n_seen]) > 3 * np.mean(gaps[n_ubatch:])  # the second ubatch: no window cut


def logit_gap_figure(gaps: list[float], first: int, n_seen: int):
    """A bar per token of the decode: how far its logits are from the text's own (a cache that kept everything);
    the tokens whose window the dry run's purge cut are drawn in vermillion."""
    import plotly.graph_objects as go

    positions = list(range(first, first + len(gaps)))
    colours = ["#D55E00" if k < n_seen else "#0072B2" for k in range(len(gaps))]
    figure = go.Figure(go.Bar(x=positions, y=gaps, marker_color=colours,
                              hovertemplate="position %{x}: %{y:.3f}<extra></extra>"))
    figure.update_layout(title=dict(text="sequence 1's decode of two ubatches: each token's largest logit difference "
                                         "from the text's own", font=dict(size=13)),
                         xaxis_title="position (vermillion: its window lost positions in the dry run)",
                         yaxis_title="max |logit difference|", height=320, width=900, template="plotly_white",
                         margin=dict(l=60, r=10, t=50, b=50))
    return figure


# ---- 3. seq_div's sign ------------------------------------------------------------------------------------------
def shift_text(e: ev.CellsShifted) -> str:
    """A seq_add / seq_div event in words: old and new positions, the pending shift the cells now carry."""
    old, new, shift = e.old_pos[0].tolist(), e.changes[0].pos.tolist(), e.changes[0].shift.tolist()
    mark = "  ! QUIRK" if e.quirk else ""
    return f"{e.op}: positions {old} became {new}, pending shift {shift}{mark}"


def check_div_sign(div: ev.CellsShifted, add: ev.CellsShifted) -> None:
    """seq_add stores new - old (right); seq_div stores old - new (the QUIRK), and only it is marked."""
    assert not add.quirk and (add.changes[0].shift == add.changes[0].pos - add.old_pos[0]).all()
    assert div.quirk and (div.changes[0].shift == div.old_pos[0] - div.changes[0].pos).all()


def shifts_since(watcher: Watcher, mark: int, cache: str = "base") -> list[ev.CellsShifted]:
    """The position moves (seq_add, seq_div) of `cache` since the watcher had counted `mark` events."""
    watcher.poll()
    return [e for e in watcher.events_since(mark) if isinstance(e, ev.CellsShifted) and e.cache == cache]


def rotations(events: list[ev.Event], cache: str = "base") -> dict[int, int]:
    """The K-shift's rotation per cell (KShiftApplied)."""
    shifted = [e for e in events if isinstance(e, ev.KShiftApplied) and e.cache == cache][0]
    return dict(zip(shifted.changes[0].cells.tolist(), shifted.amounts[0].tolist()))


# ---- 4 and 5. llama-server ---------------------------------------------------------------------------------------
SHORT_CHAT = {"system": "Be brief.", "conversations": [{"slot": 0, "turns": [
    {"user": "Who was Moses?", "assistant": "A prophet."},
    {"user": "And Aaron?", "assistant": "His brother."}]}]}
REASONING_CHAT = {"system": "Be brief.", "reasoning": "strip", "conversations": [{"slot": 0, "turns": [
    {"user": "Who was Moses?",
     "assistant": "<think>He asks about Moses.</think>A prophet of Israel who led the people out of Egypt."},
    {"user": "And Aaron?", "assistant": "His brother."}]}]}


@dataclass
class Served:
    """A chat run to its end on a simulated one-slot llama-server."""

    watcher: Watcher

    def decisions(self) -> list[ev.ServerPromptReused]:
        return [e for e in self.watcher.recent if isinstance(e, ev.ServerPromptReused)]

    def last(self) -> ev.ServerPromptReused:
        return self.decisions()[-1]

    def moves(self) -> list[ev.CellsShifted]:
        """The cells --cache-reuse moved into place."""
        return [e for e in self.watcher.recent if isinstance(e, ev.CellsShifted) and "--cache-reuse" in e.cause]


def serve(model, chat: dict, *, ctx_checkpoints: int = 32, swa_full: bool = False, cache_reuse: int = 0,
          reasoning: str | None = None) -> Served:
    """The chat on a simulated llama-server with one slot (the `server` workload), stepped to the end.
    reasoning: replace the chat's ("keep": earlier answers' <think> blocks rendered as generated)."""
    chat = dict(chat, reasoning=reasoning) if reasoning else chat
    path = scratch_folder() / "quirks-chat.json"
    path.write_text(json.dumps(chat), encoding="utf-8")
    session = Session(model, settings=dict(n_ctx=256, n_seq_max=1, pad=16, swa_full=swa_full), threaded=False,
                      threads=1, workload=WorkloadSpec("server", n_clients=1, chat=str(path),
                                                       sampler={"temperature": 0.0}, ctx_checkpoints=ctx_checkpoints,
                                                       cache_reuse=cache_reuse))
    watcher = Watcher.of(session, recent=20_000)
    while session.step(100).result()[-1].phase != "idle":
        pass
    watcher.poll()
    session.close()
    return Served(watcher)


def long_first_message(chat: dict) -> dict:
    """The chat with a first user message long enough that the second turn's common prefix passes the window."""
    first, *rest = chat["conversations"][0]["turns"]
    long_first = dict(first, user=first["user"] + " " + PASSAGE[:400])
    return dict(chat, conversations=[dict(chat["conversations"][0], turns=[long_first, *rest])])


def search_text(decision: ev.ServerPromptReused) -> str:
    """llama-server's `pos_min >= pos_min_thold` test of a decision, in words, with what it led to."""
    searched = decision.pos_min >= decision.pos_min_thold
    verdict = ("not below it: the server went to its checkpoints" if searched else
               f"below it: the prefix was reused ({decision.n_past} tokens) and no search happened")
    return (f"{decision.n_common} tokens in common: the window needs positions from {decision.pos_min_thold} on, "
            f"the cache holds them from {decision.pos_min} on, {verdict}")


def check_search_though_cached(served: Served, n_swa: int) -> None:
    """The second turn's window needs positions from 0 on, the cache holds them from 0 on, and still the server
    went to its checkpoints (or forced a full re-processing): `pos_min >= pos_min_thold` with both 0."""
    second = served.last()
    assert second.pos_min == second.pos_min_thold == 0 and second.n_common < n_swa
    assert second.quirk and second.n_past < second.n_common


def check_reuse_moved(served: Served) -> None:
    """--cache-reuse moved a chunk of the previous answer into place, and the decision carries the QUIRK."""
    second = served.last()
    assert second.n_cache_reused > 0 and "QUIRK" in second.quirk and served.moves()


# ---- 6. QUIRKs without a quirk text -----------------------------------------------------------------------------
def sequence_past_the_window(model, n: int = 160, keep: int = 40) -> tuple[engine.Context, Watcher]:
    """n positions of sequence 0 decoded in ubatches of 16 (the SWA cache, 64 + 16 = 80 cells, purges the old
    ones as it goes), then seq_rm of every position from `keep` on."""
    ctx, watcher = context(model, n_ctx=240, n_ubatch=16)  # base 240, swa 80 cells: whole rows of 40 in a grid
    assert ctx.memory.swa.size == ctx.cache_config.n_swa + 16
    for p0 in range(0, n, 16):
        assert decode(ctx, watcher, seq=0, p0=p0, n=16)[0] == 0
    assert ctx.memory.swa.seq_pos_min(0) >= keep  # the window purged the positions below `keep` from swa
    ctx.memory.seq_rm(0, keep, -1)
    return ctx, watcher


def future_cells(watcher: Watcher, seq: int = 0) -> int:
    """Base cells that hold the sequence at a position after its next token's: that token cannot see them."""
    watcher.poll()
    seen = visibility(watcher.mirror, seq)
    return int((seen.caches["base"].codes == CellVisibility.FUTURE).sum())


def ubatch_sizes(watcher: Watcher) -> list[int]:
    """The ubatch sizes of the latest decode (DecodeFinished)."""
    watcher.poll()
    return list([e for e in watcher.recent if isinstance(e, ev.DecodeFinished)][-1].ubatch_sizes)


def orphan_cells(ctx: engine.Context, cache: str = "base") -> int:
    """Cells that hold a position but no sequence: no sequence operation will ever free them."""
    return sum(1 for pos, seqs, _ in getattr(ctx.memory, cache).cells(0) if pos >= 0 and not seqs)


def cells_text(cells, n: int) -> list[str]:
    """The first n cells of a stream in words: position and the sequences that hold it."""
    out = []
    for k, (pos, seqs, _) in enumerate(cells[:n]):
        owners = ", ".join(str(s) for s in sorted(seqs)) if seqs else "no sequence"
        out.append(f"cell {k}: position {pos}, held by {'sequence ' + owners if seqs else owners}")
    return out


def is_masked(n_swa: int, p_cell: int, p_token: int) -> bool:
    """llama_hparams::is_masked_swa for the demo model's standard window."""
    return bool(is_masked_swa(n_swa, SwaType.STANDARD, p_cell, p_token))


