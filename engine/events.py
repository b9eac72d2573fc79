"""Typed event records and the bus that carries them from the engine to its watchers.

The engine publishes one event per operation (a ubatch placed, a sequence removed, a K-shift run),
carrying numpy arrays for the cells it touched. Each cell change event gives the complete new
metadata of every touched cell plus the stream's head afterwards, so a watcher can rebuild the cache
exactly from the events alone (see engine/watch/mirror.py) without knowing the rules that produced them.

Watchers subscribe through bounded queues: a slow watcher loses events (counted, and announced to
it by an EventsDropped record) but never blocks or breaks generation.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator

import numpy as np

SCHEMA_VERSION = 2  # 2: provenance (cause, tokens, step), sessions, vocabulary, attention weights
CALLBACK_INTERVAL = 0.05  # seconds a subscribe_callback thread waits to deliver events in batches

log = logging.getLogger("kvscope.events")


def _frozen_array(values, dtype=np.int64) -> np.ndarray:
    arr = np.array(values, dtype=dtype, copy=True)
    arr.flags.writeable = False
    return arr


def _frozen_fresh(arr: np.ndarray, dtype=np.int64) -> np.ndarray:
    """An array only its caller holds (a fancy-indexed copy, a packbits result), made read-only in place:
    the copy _frozen_array makes would be the second one (events are built on the decode's thread)."""
    if arr.dtype != dtype or not arr.flags.owndata:
        return _frozen_array(arr, dtype)
    arr.flags.writeable = False
    return arr


SEQ_BITS_BYTES = 32  # a cell's sequence bitset: LLAMA_MAX_SEQ = 256 bits


def pack_seq_bits(seq_matrix: np.ndarray) -> np.ndarray:
    """(MAX_SEQ, n) bool -> (n, MAX_SEQ // 8) uint8, one bitset row per cell."""
    return _frozen_fresh(np.packbits(seq_matrix.T, axis=1, bitorder="little"), np.uint8)


def unpack_seq_bits(bits: np.ndarray) -> np.ndarray:
    """(n, MAX_SEQ // 8) uint8 -> (MAX_SEQ, n) bool."""
    return np.unpackbits(bits, axis=1, bitorder="little").astype(bool).T


_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.int16)


def seq_counts(bits: np.ndarray) -> np.ndarray:
    """The number of sequences in each cell of packed bitsets (n, 32) -> (n,) int16."""
    return _POPCOUNT[bits].sum(axis=1, dtype=np.int16)


def lowest_seq_ids(bits: np.ndarray) -> np.ndarray:
    """The lowest sequence id of each cell of packed bitsets (n, 32) -> (n,) int16; -1 for an empty one.
    Byte by byte: no unpacking of every cell to 256 bools."""
    nonzero = bits != 0
    first_byte = nonzero.argmax(axis=1)
    byte = bits[np.arange(len(bits)), first_byte].astype(np.int16)
    low_bit = np.log2((byte & -byte).clip(min=1)).astype(np.int16)
    return np.where(nonzero.any(axis=1), first_byte.astype(np.int16) * 8 + low_bit, -1).astype(np.int16)


@dataclass(frozen=True, eq=False)
class Event:
    """Base record. `seq_no` and `time` are stamped by the bus when the event is published."""

    version: ClassVar[int] = SCHEMA_VERSION
    seq_no: int = field(default=-1, kw_only=True)
    time: float = field(default=0.0, kw_only=True)

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, eq=False)
class StreamCells:
    """The new metadata of some cells of one stream, and the stream's head after the change."""

    stream: int
    cells: np.ndarray  # cell indices
    pos: np.ndarray  # new position per cell (-1 = empty)
    shift: np.ndarray  # new pending shift per cell
    seq_bits: np.ndarray  # (n, 32) uint8 bitsets of sequence ids
    head: int

    def seq_sets(self) -> list[frozenset[int]]:
        matrix = unpack_seq_bits(self.seq_bits)
        return [frozenset(int(s) for s in np.flatnonzero(matrix[:, j])) for j in range(matrix.shape[1])]


@dataclass(frozen=True, eq=False)
class CellsChanged(Event):
    """Base of every event that changes cell metadata. `cache` names the cache ("kv", or "base"
    and "swa" of an iSWA pair); `tentative` marks dry-run changes, which a SlotsRolledBack event
    undoes, except the SWA purge of a dry run, which persists (see `quirk`)."""

    cache: str
    changes: tuple[StreamCells, ...]
    tentative: bool = False
    quirk: str = ""  # set when the change is llama.cpp behaviour that looks unintended (the QUIRK_* texts of engine/kv/cache.py)
    cause: str = ""  # who asked for it, above the cache: "context shift", "request finished", "command: seq_rm", ...


@dataclass(frozen=True, eq=False)
class CellsAllocated(CellsChanged):
    """A ubatch's tokens were placed in cells (apply_ubatch). tokens[k]: the token id of each cell of
    changes[k], in the same order."""

    ubatch: int = 0
    n_tokens: int = 0
    tokens: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True, eq=False)
class CellsRemoved(CellsChanged):
    """Sequences were removed from cells. reason: seq_rm, seq_keep, clear, purge, failure_cleanup."""

    reason: str = "seq_rm"
    seq_id: int = -1
    p0: int = -1
    p1: int = -1
    n_freed: int = 0


@dataclass(frozen=True, eq=False)
class CellsCopied(CellsChanged):
    """seq_cp. Same stream: metadata only (`queued` False). Across streams: the destination stream
    was reset to the source's metadata and a copy of its K/V rows is queued for the next update."""

    src_seq: int = 0
    dst_seq: int = 0
    queued: bool = False
    src_stream: int = 0
    dst_stream: int = 0


@dataclass(frozen=True, eq=False)
class CellsShifted(CellsChanged):
    """seq_add (op "add", amount = delta) or seq_div (op "div", amount = divisor)."""

    op: str = "add"
    seq_id: int = 0
    p0: int = 0
    p1: int = 0
    amount: int = 0
    old_pos: tuple[np.ndarray, ...] = ()


POS_UNKNOWN = 2**31 - 1  # a held cell whose position its source did not say (a log's unreadable position row)
# What a CellsSeen's seq_bits mean where the log leaves them open (its `uncertain` codes; 0: the cell's sequences)
SEQS_SHARED_UNNAMED = 1  # an 'M' cell: two or more of these sequences hold it
SEQS_READ_TWO_WAYS = 2  # a map with ids of several lengths reads more than one way here: one or more of these


@dataclass(frozen=True, eq=False)
class CellsSeen(CellsChanged):
    """Cells as a log's slot-search dump showed them: a real llama.cpp read from its own log
    (engine/watch/llama_log). `changes` holds the cells that differ from the previous dump of their stream
    (all of them for a stream's first dump). What a dump cannot tell is marked, never invented: where
    uncertain[k][j] is not 0, the seq_bits of cell changes[k].cells[j] are only the sequences that may hold
    it: SEQS_SHARED_UNNAMED for a cell shared by several ('M'; those whose min..max covers its position),
    SEQS_READ_TWO_WAYS where a map of ids of several lengths ("1", "12") splits more than one way; a pos of
    POS_UNKNOWN is a held cell whose position the dump's row did not give. A dump shows no pending shift:
    shift is 0. `ubatch` counts the slot searches since the log began."""

    ubatch: int = -1
    uncertain: tuple[np.ndarray, ...] = ()  # uint8 per cell: 0, SEQS_SHARED_UNNAMED or SEQS_READ_TWO_WAYS


@dataclass(frozen=True, eq=False)
class SlotsRolledBack(CellsChanged):
    """The dry run of a decode restored the cells and heads it had tentatively changed."""


@dataclass(frozen=True, eq=False)
class StreamCopyExecuted(Event):
    """A queued cross-stream copy of K/V rows ran at the start of a decode."""

    cache: str
    src_stream: int
    dst_stream: int
    n_layers: int


@dataclass(frozen=True, eq=False)
class KShiftApplied(CellsChanged):
    """Stored keys were re-rotated by each cell's pending shift; shifts are now 0 everywhere.
    `changes` lists the shifted cells with shift 0, one record per stream; `amounts[k]` gives the shift
    applied to each cell of changes[k]."""

    amounts: tuple[np.ndarray, ...] = ()
    n_layers: int = 0


@dataclass(frozen=True, eq=False)
class MemorySnapshot(CellsChanged):
    """The full state of every stream, published on request (e.g. to resync a watcher)."""


@dataclass(frozen=True, eq=False)
class ContextCreated(Event):
    """A context and its cache exist. Sizes as in llama.cpp's init lines."""

    cache: str
    n_ctx: int
    n_ctx_seq: int
    kv_size: int
    n_stream: int
    n_seq_max: int
    n_layer: int
    type_k: str
    type_v: str
    v_trans: bool
    k_bytes: int
    v_bytes: int
    n_batch: int
    n_ubatch: int
    pad: int
    unified: bool
    model_name: str
    log_lines: tuple[str, ...]
    layer_ids: tuple[int, ...] = ()  # model layers stored in this cache
    n_swa: int = 0  # sliding window of this cache (0: full attention)
    n_swa_train: int = 0  # the window the model was trained with (differs from n_swa after swa_window=)
    swa_type: int = 0


@dataclass(frozen=True, eq=False)
class ModelPlaced(Event):
    """Where a context's model weights live (llama_model_base::load_tensors, src/llama-model.cpp). weight_bytes: (device name, bytes) per
    device holding any weight, the input embedding included. layer_devices: each layer's device from
    -ngl (its residual stream and, unless -nkvo, K/V); overridden: (llama.cpp tensor name, device
    name) for weights an -ot pattern sent elsewhere. shared: the weights were already placed so by a live context."""

    model_name: str
    layer_devices: tuple[str, ...]
    output_device: str
    weight_bytes: tuple[tuple[str, int], ...]
    shared: bool = False
    overridden: tuple[tuple[str, str], ...] = ()
    kv_devices: tuple[str, ...] = ()  # each layer's K/V device (the CPU for every layer with -nkvo)


@dataclass(frozen=True, eq=False)
class DeviceMemoryChanged(Event):
    """Bytes put on (delta > 0) or taken off (delta < 0) a device for `what` ("weights", "kv" or
    "compute"). reserved: a virtual device's reserved bytes after the change; None for a real device,
    whose memory torch tracks. capacity: None where unknown."""

    device: str
    virtual: bool
    capacity: int | None
    reserved: int | None
    what: str
    delta: int


@dataclass(frozen=True)
class DeviceBytes:
    """What one context holds on one device (absolute), and the device's ledger."""

    device: str
    virtual: bool
    capacity: int | None
    reserved: int | None  # a virtual device's reserved bytes, all contexts together; None for real ones
    weights: int
    kv: int
    compute: int
    checkpoints: int = 0  # a server simulation's context checkpoints (host memory)
    prompt_cache: int = 0  # and its prompt cache (--cache-ram)


@dataclass(frozen=True, eq=False)
class DeviceMemoryState(Event):
    """The whole device memory picture of a context, for a watcher that joins late (publish_state):
    later DeviceMemoryChanged events apply on top of it."""

    devices: tuple[DeviceBytes, ...]


@dataclass(frozen=True, eq=False)
class DecodeStarted(Event):
    """A llama_decode call begins. step: the context's decode count (0 for its first decode); every cell
    event until the matching DecodeFinished belongs to this step."""

    n_tokens: int
    n_outputs: int
    seq_ids: tuple[int, ...]
    step: int = -1


@dataclass(frozen=True, eq=False)
class SequenceAssigned(Event):
    """A runner gave a sequence id a job: `request` names it (a client's request, a prompt), `prompt` is
    its text. Cells of that sequence from here on belong to it."""

    seq_id: int
    request: str
    prompt: str
    n_prompt_tokens: int = 0


@dataclass(frozen=True, eq=False)
class SessionStatus(Event):
    """Where a session (engine/runners/session.py) stands. state: "running", "paused", "idle" (running,
    with nothing to do), "finished" (the workload ended), "stopped" or "closed". step: workload steps
    done. steps_per_second: the speed limit, 0 for as fast as possible."""

    state: str
    step: int
    workload: str
    steps_per_second: float = 0.0
    message: str = ""


@dataclass(frozen=True, eq=False)
class CommandDone(Event):
    """A session command ran: `command` is its name, `args` its arguments as text; ok, or the error's
    message. A failing command changes nothing and stops nothing else."""

    command: str
    args: str
    ok: bool
    error: str = ""
    ms: float = 0.0


@dataclass(frozen=True, eq=False)
class WorkloadStep(Event):
    """One step of a session's workload: its decodes (n_tokens in all, the last return code), the tokens
    it sampled, and the sequences still generating afterwards."""

    step: int
    workload: str
    phase: str
    n_tokens: int
    n_sampled: int
    rc: int
    ms: float
    active_seqs: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class Vocabulary(Event):
    """The text of every token id of the context's model (pieces[id], as decoded alone), so that a
    watcher with no tokenizer (a replay, a remote viewer) can say which token a cell holds."""

    model_name: str
    pieces: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class DecodeFinished(Event):
    """rc as llama_decode returns it; ubatch_sizes as split; ms_* wall times."""

    rc: int
    n_tokens: int
    ubatch_sizes: tuple[int, ...]
    ms_total: float
    ms_per_ubatch: tuple[float, ...] = ()
    message: str = ""


@dataclass(frozen=True, eq=False)
class SlotSearchFailed(Event):
    cache: str
    stream: int
    n_tokens: int
    size: int
    used: int
    head: int


@dataclass(frozen=True, eq=False)
class TokenSampled(Event):
    seq_id: int
    token: int
    piece: str
    pos: int


SERVER_LOG_LETTERS = {"info": "I", "warn": "W", "error": "E", "debug": "D"}  # common/log.cpp's level marks


@dataclass(frozen=True, eq=False)
class ServerLogLine(Event):
    """One line of the simulated llama-server's log, in its words (engine/runners/server/log.py), without
    the time prefix; slot and task -1 for a server line."""

    level: str  # a key of SERVER_LOG_LETTERS
    text: str
    slot: int = -1
    task: int = -1


@dataclass(frozen=True, eq=False)
class ServerTaskStarted(Event):
    """A task (one request) took a slot: chosen by its id, by the similarity of the slot's kept tokens to the
    prompt, or as the least recently used one."""

    slot: int
    task: int
    selected_by: str  # "id", "similarity", "lru"
    similarity: float  # common prefix / new prompt length (-1: not computed)
    n_prompt: int
    label: str = ""
    n_ctx_slot: int = -1  # the slot's context (-1: not known)


@dataclass(frozen=True, eq=False)
class ServerContextShifted(Event):
    """A slot's sequence reached the end of its context and llama-server made room (--context-shift): it
    kept the first n_keep tokens, discarded the n_discard after them and moved the rest back."""

    slot: int
    task: int
    n_keep: int
    n_left: int
    n_discard: int


@dataclass(frozen=True, eq=False)
class ServerPromptReused(Event):
    """The server's decision for a new prompt: of the tokens its slot kept, n_past serve the new prompt (the
    common prefix, less what the cache cannot serve), and n_prompt - n_past are processed."""

    slot: int
    task: int
    n_prompt: int
    n_kept: int  # tokens the slot's sequence held
    n_common: int  # common prefix of those and the new prompt (with --cache-reuse chunks: after them)
    n_past: int
    n_cache_reused: int = 0  # tokens moved into place by --cache-reuse chunk shifting
    forced_full: bool = False  # "forcing full prompt re-processing due to lack of cache data"
    why: str = ""
    pos_min: int = -1  # the sequence's lowest position (an iSWA pair: in the SWA cache), -1: not read
    pos_min_thold: int = -1
    restored_n_tokens: int = -1  # the restored checkpoint's token count, -1: none
    quirk: str = ""  # set when llama-server's rule searched its checkpoints though the cache served the prefix


@dataclass(frozen=True, eq=False)
class CheckpointChanged(Event):
    """A slot's context checkpoint created, restored or erased (why: "invalidated", "old", "too close",
    "superseded", "slot cleared"); n_bytes is host memory (llama-server keeps checkpoints in RAM)."""

    slot: int
    task: int
    action: str  # "created", "restored", "erased"
    pos_min: int
    pos_max: int
    n_tokens: int
    n_bytes: int
    why: str = ""
    n_held: int = 0  # the slot's checkpoints after this


@dataclass(frozen=True, eq=False)
class ServerSlotChanged(Event):
    """What a slot keeps changed outside a task: cleared (after its state was saved to the prompt cache with
    one buffer for all sequences, after a failed task) or cut by a command on its sequence."""

    slot: int
    n_kept: int
    why: str


@dataclass(frozen=True, eq=False)
class ServerTaskFinished(Event):
    """A task ended (stop: "limit", "eos", "context", "error"); its prompt's tokens reused from the cache
    and processed, and what the slot keeps for the next task."""

    slot: int
    task: int
    n_prompt: int
    n_cached: int
    n_processed: int
    n_generated: int
    stop: str
    text: str
    n_kept: int
    label: str = ""
    error: str = ""


@dataclass(frozen=True, eq=False)
class LogStats(Event):
    """How the reading of a llama.cpp log goes (engine/runners/attach.py): bytes and lines read, lines not
    understood (skipped), slot-search dumps read and dumps dropped to keep up (the next dump of a stream is
    a full keyframe of it, so a drop delays the picture and loses nothing of the end state)."""

    source: str  # "llama-server (pid 1234)", a log file's path
    bytes: int
    lines: int
    skipped: int
    dumps: int
    dumps_dropped: int
    behind_bytes: int = 0  # read from the process or file and not parsed yet


@dataclass(frozen=True, eq=False)
class ProcessExited(Event):
    """A process kvscope attached to ended: its exit status (negative: killed by that signal) and the last
    lines it printed."""

    program: str
    pid: int
    returncode: int
    last_lines: tuple[str, ...] = ()
    ended_by_kvscope: bool = False  # kvscope ended it (quit, Ctrl+C, SIGTERM), rather than it ending itself


# ---- a prefix cache of hashed blocks, as vLLM and SGLang publish it (engine/watch/kv_events, block_mirror.py) ----
MEDIUM_GPU = "GPU"  # what vLLM's BlockStored/BlockRemoved mean when they leave `medium` out (or send None)


@dataclass(frozen=True, eq=False)
class KvWorkerSeen(Event):
    """A worker whose prefix cache a KV event stream describes: one vLLM or SGLang data-parallel rank behind one
    publisher endpoint. `worker` is kvscope's number for it, in the order workers were first heard from; every
    block event names its worker by that number."""

    worker: int
    endpoint: str  # the publisher's PUB endpoint, "tcp://10.0.0.5:5557"
    rank: int = -1  # the batches' data_parallel_rank; -1 where the publisher does not say
    label: str = ""  # "worker 1 (rank 1 at 10.0.0.5:5558)"
    capacity_blocks: int = 0  # blocks the worker can hold (per medium and group), where known; 0: not known
    dialect: str = ""  # the wire format its batches came in (engine/watch/kv_events/formats.py)


@dataclass(frozen=True, eq=False)
class BlocksStored(Event):
    """A worker's prefix cache now holds these full blocks (vLLM's BlockStored): block k holds token_ids[k *
    block_size:(k + 1) * block_size]; each block is the child of the one before it, the first the child of
    `parent_hash` (None: the chain starts here). Hashes are the publisher's, as bytes: an integer hash is its 8
    big-endian bytes, unsigned."""

    worker: int
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: np.ndarray  # int64, len(block_hashes) * block_size (fewer where the publisher sent fewer)
    block_size: int
    medium: str = MEDIUM_GPU  # "GPU", "CPU", "DISK", ...: the tier that holds them
    lora: str = ""  # the LoRA adapter the blocks were computed with (lora_name, or "id N" from lora_id)
    group: int = 0  # vLLM's KV cache group (group_idx): full attention and each sliding window apart
    group_kind: str = ""  # kv_cache_spec_kind: "full_attention", "sliding_window", ... ("" unknown)
    sliding_window: int = 0  # kv_cache_spec_sliding_window, tokens (0: none or unknown)
    extra_keys: tuple[str, ...] = ()  # per block, the publisher's extra hash keys as text ("" none)
    ts: float = 0.0  # the publisher's wall clock (seconds since the epoch) of the batch that said it


@dataclass(frozen=True, eq=False)
class BlocksRemoved(Event):
    """A worker's prefix cache no longer holds these blocks in this medium and group (evicted, vLLM's
    BlockRemoved)."""

    worker: int
    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU
    group: int = 0
    ts: float = 0.0
    cause: str = ""  # "" (the publisher said so), or kvscope's reason: "publisher restarted"


@dataclass(frozen=True, eq=False)
class BlocksCleared(Event):
    """A worker's prefix cache was emptied (vLLM's AllBlocksCleared, a prefix-cache reset), or kvscope empties
    its picture of it (`cause`: a publisher that restarted holds nothing it held before)."""

    worker: int
    ts: float = 0.0
    cause: str = ""


@dataclass(frozen=True, eq=False)
class BlockSnapshot(Event):
    """Every block one worker holds in one medium and group, with when each was stored, and the blocks it
    evicted last: the state a late subscriber or a recording's keyframe starts from (block_mirror.py). Parallel
    arrays over the blocks; tokens of block k are token_ids[token_starts[k]:token_starts[k + 1]]."""

    worker: int
    medium: str
    group: int
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes | None, ...]
    token_ids: np.ndarray
    token_starts: np.ndarray  # len(block_hashes) + 1
    block_sizes: np.ndarray
    stored_ts: np.ndarray  # float64, the publisher's clock
    stored_seq_nos: np.ndarray  # int64, the BlocksStored event of each
    lora: tuple[str, ...] = ()
    group_kind: str = ""
    sliding_window: int = 0
    roots: tuple[bytes, ...] = ()  # the first block of each one's chain, as the mirror knew it (block_mirror.py)
    depths: np.ndarray | None = None  # blocks before each one in its chain (-1: not known)
    # Set on a snapshot of the eviction log rather than of held blocks: when each of these blocks was evicted
    # (the publisher's clock) and why ("" the publisher said so), oldest first.
    evicted_ts: np.ndarray | None = None
    evicted_causes: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class KvBatchesLost(Event):
    """Batches a publisher sent that kvscope did not get: the sequence numbers first..last of `endpoint`.
    `recovered` of them came back through the replay endpoint (and were applied in order before the batch
    that showed the gap); the rest are lost, and the picture of that publisher's workers may miss blocks
    until they are stored again or cleared."""

    endpoint: str
    first: int
    last: int
    recovered: int = 0
    reason: str = ""  # why not all came back: "no replay endpoint", "the publisher's buffer no longer holds them"

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    @property
    def lost(self) -> int:
        return self.count - self.recovered


@dataclass(frozen=True, eq=False)
class KvPublisherRestarted(Event):
    """A publisher's sequence numbers went back (from `last_seq` to `seq`): it restarted, and everything it said
    before is void. Its workers' blocks are cleared; `epoch` counts the restarts seen."""

    endpoint: str
    last_seq: int
    seq: int
    epoch: int


@dataclass(frozen=True, eq=False)
class KvEventStats(Event):
    """How the reading of one publisher goes (engine/watch/kv_events/subscriber.py), about once a second."""

    endpoint: str
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    lost: int = 0  # batches lost for good
    replayed: int = 0  # batches recovered through the replay endpoint
    malformed: int = 0  # messages that were not a batch (skipped; never fatal)
    unknown_tags: int = 0  # events of a kind kvscope does not know (skipped)
    unknown_fields: int = 0  # fields kvscope does not know (ignored)
    other_topics: int = 0  # messages of a topic not asked for
    epochs: int = 1  # 1 + the restarts seen
    dialect: str = ""


@dataclass(frozen=True, eq=False)
class EventsDropped(Event):
    """Delivered to one subscriber only: it missed `count` events because its queue was full."""

    count: int
    first_seq_no: int
    last_seq_no: int


@dataclass(frozen=True, eq=False)
class AttentionWeights(Event):
    """Where a sequence's last output token of decode `step` looked (Context(publish_attention=True)):
    its attention probabilities over the cells, after the mask, averaged over the query heads.

    One record per cache that holds some of the model's layers ("kv", or "base" and "swa" of an iSWA
    pair), as parallel tuples: record k covers layers layer_ids[k] of cache caches[k], stream
    streams[k], and weights[k] is float32 [len(layer_ids[k]), len(cells[k])] over those cell indices
    (the attention window, cells 0 .. n_kv - 1), each row summing to 1 and 0 on masked cells. A token
    shared by several sequences was masked as its last listed one, so all of them get its weights.
    The cells are as that token's ubatch saw them: a later ubatch of the same decode may reuse one."""

    seq_id: int
    step: int
    batch_index: int  # the token's index in its batch
    pos: int
    caches: tuple[str, ...]
    streams: tuple[int, ...]
    layer_ids: tuple[tuple[int, ...], ...]
    cells: tuple[np.ndarray, ...]
    weights: tuple[np.ndarray, ...]


@dataclass(frozen=True, eq=False)
class OutputLogProbs(Event):
    """The next-token distributions of decode `step` (Context(publish_logits=True)): row k is the
    log-softmax of the logits of the batch's k-th output token, float32 [n_outputs, n_vocab], in batch
    order, with that token's (first) sequence and position. What an A/B view compares two contexts by."""

    step: int
    seq_ids: tuple[int, ...]
    positions: tuple[int, ...]
    logprobs: np.ndarray


class Subscription:
    """A bounded queue of events for one watcher. Never blocks the publisher."""

    def __init__(self, bus: "EventBus", maxsize: int, kinds: tuple[type, ...] | None) -> None:
        assert maxsize > 0, "a subscription needs room for at least one event"
        self._bus = bus
        self._queue: collections.deque[Event] = collections.deque()
        self._maxsize = maxsize
        self._kinds = kinds
        self._cond = threading.Condition()
        self._waiting = 0  # readers blocked in get(): only they need a notify (a Python-level call per event)
        self._missed = 0
        self._missed_first = -1
        self._missed_last = -1
        self.dropped = 0  # total events this watcher never received
        self.callback_errors = 0  # exceptions raised by a subscribe_callback watcher
        self.closed = False
        self.left_out: tuple[type, ...] = ()  # kinds this watcher never wants (a view: the big OutputLogProbs)

    def _offer(self, event: Event) -> None:
        if self._kinds is not None and not isinstance(event, self._kinds):
            return
        if self.left_out and isinstance(event, self.left_out):
            return
        with self._cond:
            if len(self._queue) >= self._maxsize:
                self.dropped += 1
                self._missed += 1
                if self._missed_first < 0:
                    self._missed_first = event.seq_no
                self._missed_last = event.seq_no
                return
            if self._missed:
                # The notice rides in one slot beyond maxsize, so that even a queue of one gets it
                # together with the event that follows the gap.
                notice = EventsDropped(self._missed, self._missed_first, self._missed_last)
                object.__setattr__(notice, "seq_no", event.seq_no)
                object.__setattr__(notice, "time", event.time)
                self._queue.append(notice)
                self._missed, self._missed_first, self._missed_last = 0, -1, -1
            self._queue.append(event)
            if self._waiting:
                self._cond.notify()

    def get(self, timeout: float | None = None) -> Event | None:
        """Next event, waiting up to `timeout` seconds (None: forever); None on timeout/close."""
        with self._cond:
            if not self._queue and not self.closed:
                self._waiting += 1
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting -= 1
            return self._queue.popleft() if self._queue else None

    def drain(self) -> list[Event]:
        """All queued events, without waiting."""
        with self._cond:
            out = list(self._queue)
            self._queue.clear()
            return out

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        self._bus._remove(self)
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class EventBus:
    """Publishes events to subscriptions. Thread-safe; publishing costs O(subscribers)."""

    def __init__(self) -> None:
        # Reentrant: memory released by a garbage-collection finalizer is published, and collection
        # can run on a thread that is inside publish() already. Such an event waits in _pending until
        # the one being delivered has reached every subscriber, so that all see seq_no order.
        self._lock = threading.RLock()
        self._subs: tuple[Subscription, ...] = ()
        self._next_seq_no = 0
        self._delivering = False
        self._pending: list[Event] = []
        # Whoever publishes state here (a Context) registers a function that describes that state as
        # events, so that a watcher subscribing late starts from it. Weak: the bus keeps no context alive.
        self._state_sources: list[weakref.WeakMethod] = []
        self._causes: list[str] = []  # set by the thread that drives the engine (see cause())

    @contextlib.contextmanager
    def cause(self, text: str) -> Iterator[None]:
        """Cell events published inside this block carry `cause=text` (the innermost block wins), so
        that a viewer can say why a cell changed: a context shift, a finished request, a command."""
        self._causes.append(text)
        try:
            yield
        finally:
            self._causes.pop()

    @property
    def current_cause(self) -> str:
        return self._causes[-1] if self._causes else ""

    def add_state_source(self, state_events: Callable[[], list[Event]]) -> None:
        """Register a bound method returning the events that describe its owner's current state; every
        later subscriber receives them first (see subscribe), in the order of registration. Registering
        one again moves it to the end."""
        with self._lock:
            self._state_sources = [r for r in self._state_sources if r() is not None and r() != state_events]
            self._state_sources.append(weakref.WeakMethod(state_events))

    def current_state(self) -> list[Event]:
        """The state of every live context on this bus, as events stamped with the seq_no of the last
        event published before it (taken under the bus lock, so nothing is published meanwhile)."""
        with self._lock:
            return self._stamped_state()

    def _stamped_state(self) -> list[Event]:
        events = []
        for ref in self._state_sources:
            source = ref()
            if source is not None:
                events += source()
        for event in events:  # they describe the state as of the last published event
            object.__setattr__(event, "seq_no", self._next_seq_no - 1)
            object.__setattr__(event, "time", time.monotonic())
        return events

    @property
    def active(self) -> bool:
        """True when someone listens; the engine skips building events otherwise."""
        return bool(self._subs)

    def subscribe(self, maxsize: int = 65536, kinds: tuple[type, ...] | None = None,
                  with_state: bool = True) -> Subscription:
        """A new watcher. with_state: it first receives the current state of every live context on this
        bus (placement, device memory, ContextCreated, a MemorySnapshot per cache), then every event
        published after it; nothing in between is lost, since both happen under the bus lock."""
        sub = Subscription(self, maxsize, kinds)
        with self._lock:
            if with_state:
                for event in self._stamped_state():
                    sub._offer(event)
            self._subs = self._subs + (sub,)
        return sub

    def subscribe_callback(self, callback: Callable[[Event], None], maxsize: int = 65536,
                           kinds: tuple[type, ...] | None = None, with_state: bool = True) -> Subscription:
        """Call `callback` for every event, in order, on a daemon thread of its own.

        The thread wakes at most once per CALLBACK_INTERVAL seconds and then delivers everything
        queued: waking per event would take CPU time from a memory-bound decode on a small machine."""
        sub = self.subscribe(maxsize, kinds, with_state)

        def pump() -> None:
            while not sub.closed:
                first = sub.get(timeout=0.2)
                if first is None:
                    continue
                time.sleep(CALLBACK_INTERVAL)
                for event in [first, *sub.drain()]:
                    try:
                        callback(event)
                    except Exception:  # a broken watcher must not stop its own pump, nor the engine
                        sub.callback_errors += 1
                        log.exception("event callback failed on %s #%d", event.kind, event.seq_no)

        threading.Thread(target=pump, name="kvscope-event-pump", daemon=True).start()
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    def publish(self, event: Event) -> None:
        with self._lock:
            if self._delivering:  # re-entered on this thread, from a finalizer inside the delivery below
                self._pending.append(event)
                return
            self._delivering = True
            try:
                self._deliver(event)
                while self._pending:
                    self._deliver(self._pending.pop(0))
            finally:
                self._delivering = False

    def _deliver(self, event: Event) -> None:
        object.__setattr__(event, "seq_no", self._next_seq_no)
        object.__setattr__(event, "time", time.monotonic())
        self._next_seq_no += 1
        # Offering under the bus lock keeps every queue in seq_no order; _offer never blocks.
        for sub in self._subs:
            sub._offer(event)


class WatchedBus:
    """What a watched source (a llama.cpp log read, KV event publishers) offers a Watcher or a Recorder, for one that
    publishes its events on `self.bus` while holding `self._lock` (a reentrant lock): subscribing and taking the
    state under that lock, a subscriber gets the state and then every later event exactly once."""

    bus: EventBus
    _lock: threading.RLock

    def subscribe(self, maxsize: int = 65536, kinds: tuple[type, ...] | None = None,
                  with_state: bool = True) -> Subscription:
        """A watcher's (or a Recorder's) subscription: the picture so far first, then every event."""
        with self._lock:
            return self.bus.subscribe(maxsize, kinds, with_state)

    def current_state(self) -> list[Event]:
        """The picture so far as events, stamped with the last event published before it."""
        with self._lock:
            return self.bus.current_state()
