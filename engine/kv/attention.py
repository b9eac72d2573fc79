"""Per-ubatch attention inputs: store the ubatch's K/V in the cache, read every visible row, and the
KQ mask built from the cells (llama_kv_cache::set_input_kq_mask, src/llama-kv-cache.cpp); and the
probe that collects where each sequence's last output token looked (Context(publish_attention=True))."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine import events as ev
from engine.batch import UBatch
from engine.kv.cells import KVCells
from engine.kv.swa import attends

if TYPE_CHECKING:
    from engine.kv.layout import CacheLayout
    from engine.kv.slot_info import SlotInfo
    from engine.kv.storage import RowStorage, Scratch


class AttentionSource(Protocol):
    """What the attention inputs read of a cache (engine/kv/cache.py KVCache is one)."""

    layout: CacheLayout
    v_cells: list[KVCells]
    k: list[RowStorage]
    v: list[RowStorage]
    layer_index: dict[int, int]
    read_scratch: tuple[Scratch, Scratch]  # where K and V rows of another float type are converted

    def n_kv(self, streams: tuple[int, ...]) -> int: ...


class UbatchAttention:
    """Per-ubatch access to the cache for the model: store this ubatch's K/V, read all visible K/V,
    and the KQ mask, built once from the cells after the ubatch was applied.

    The mask is llama.cpp's, n_kv wide (n_kv: the used cells padded to 256). The attention itself
    reads only the first n_visible cells, up to the last one some token of the ubatch sees: the cells
    after it are masked for every token, so leaving them out changes no result (their weights are
    exactly 0) and saves reading up to 255 padding cells per layer. When every token sees every one
    of those cells (one sequence decoding), no mask is passed at all: the kernel's unmasked path is
    ~20% faster at 8k cells."""

    def __init__(self, cache: AttentionSource, sinfo: SlotInfo, ubatch: UBatch) -> None:
        self.cache = cache
        self.n_groups = len(sinfo.streams)
        self.n_kv = cache.n_kv(sinfo.streams)
        streams = list(sinfo.streams)
        self._stream_slice = (slice(streams[0], streams[0] + 1) if self.n_groups == 1 else
                              torch.tensor(streams, dtype=torch.long))
        n_per = sinfo.n_per_stream
        self.token_streams = np.repeat(streams, n_per)  # the stream of each ubatch token
        self._token_stream = torch.from_numpy(self.token_streams.astype(np.int64))
        self._token_cell = torch.from_numpy(np.concatenate(sinfo.idxs).astype(np.int64))
        # where store_and_load writes: one stream's run of consecutive cells as a slice (a decode step, a
        # prompt in an empty cache), else per token
        cells = sinfo.idxs[0]
        run = self.n_groups == 1 and cells.size > 0 and bool(np.all(np.diff(cells) == 1))
        self._write_at = ((streams[0], slice(int(cells[0]), int(cells[-1]) + 1)) if run else
                          (self._token_stream, self._token_cell))
        mask = self._build_mask(sinfo, ubatch)  # [groups, 1, n_per, n_kv] bool, True = attend
        self.mask = torch.from_numpy(mask)
        seen = np.flatnonzero(mask.any(axis=(0, 1, 2)))
        self.n_visible = int(seen[-1]) + 1 if seen.size else 1
        visible = mask[..., :self.n_visible]
        # None: every token sees every one of the first n_visible cells
        self.attend_mask = None if visible.all() else torch.from_numpy(np.ascontiguousarray(visible))
        self._mask_on: dict[torch.device, torch.Tensor | None] = {torch.device("cpu"): self.attend_mask}

    def _build_mask(self, sinfo: SlotInfo, ubatch: UBatch) -> np.ndarray:
        cache, n_kv = self.cache, self.n_kv
        n_per = sinfo.n_per_stream
        lo = cache.layout
        masks = []
        for g, stream in enumerate(sinfo.streams):
            cells = cache.v_cells[stream]
            tokens = slice(g * n_per, (g + 1) * n_per)
            # A token with several sequences is masked as its last listed sequence (llama.cpp).
            deciding = np.fromiter((ids[-1] for ids in ubatch.seq_ids[tokens]), dtype=np.int64, count=n_per)
            masks.append(attends(cells.pos[:n_kv][None, :], cells.seq[deciding, :n_kv], ubatch.pos[tokens][:, None],
                                 lo.n_swa, lo.swa_type))
        return np.stack(masks)[:, None]

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        """k, v: [n_tokens, n_embd_k|v]. Returns K, V of the first n_visible cells as [groups, n_head_kv,
        n_visible, head_dim] and the layer's KQ mask over them [groups, 1, tokens per group, n_visible]
        (True = attend), or None when every token attends to all of them."""
        cache = self.cache
        i = cache.layer_index[il]
        out = []
        for rows, new, scratch in ((cache.k[i], k, cache.read_scratch[0]), (cache.v[i], v, cache.read_scratch[1])):
            rows.write(*self._write_at, new)
            heads = rows.read_heads(self._stream_slice, self.n_visible, dtype, scratch)
            out.append(heads if heads.device == k.device else heads.to(k.device))
        if k.device not in self._mask_on:  # built on the host once; one copy per device whose layers attend
            self._mask_on[k.device] = None if self.attend_mask is None else self.attend_mask.to(k.device)
        return out[0], out[1], self._mask_on[k.device]

    def parts(self) -> tuple[UbatchAttention, ...]:
        """The attention inputs of each cache behind this object: just this one."""
        return (self,)


def last_outputs(seq_ids: tuple[tuple[int, ...], ...], output: np.ndarray) -> dict[int, int]:
    """seq id -> batch index of that sequence's last output token, for every sequence that has one."""
    last: dict[int, int] = {}
    for i in np.flatnonzero(output):
        for s in seq_ids[i]:
            last[s] = int(i)
    return last


class UbatchProbe:
    """The forward pass's WeightsProbe (engine/models/transformer.py) for one ubatch: the rows wanted
    and each layer's weights, read back per cache once the ubatch is done."""

    def __init__(self, ubatch: UBatch, attn, rows: np.ndarray) -> None:
        """attn: the ubatch's attention inputs (UbatchAttention, or an iSWA pair's ISWAAttention)."""
        self.rows = rows.tolist()
        self._ubatch = ubatch
        self._parts = [part for part in attn.parts() if part.cache.layout.layer_ids]
        self._weights: dict[int, torch.Tensor] = {}

    def keep(self, il: int, weights: torch.Tensor) -> None:
        self._weights[il] = weights

    def records(self) -> dict[int, tuple]:
        """batch index -> (pos, caches, streams, layer_ids, cells, weights): AttentionWeights' fields."""
        # one host copy per cache: [n_layers of the cache, rows, n_kv]
        stacked = [torch.nn.functional.pad(torch.stack([self._weights[il] for il in part.cache.layout.layer_ids]),
                                           (0, part.n_kv - part.n_visible)).cpu().numpy()
                   for part in self._parts]  # cells after n_visible: weight 0, as the model masked them
        cells = [ev._frozen_array(np.arange(part.n_kv)) for part in self._parts]
        out = {}
        for k, r in enumerate(self.rows):
            out[int(self._ubatch.idxs[r])] = (
                int(self._ubatch.pos[r]),
                tuple(part.cache.name for part in self._parts),
                tuple(int(part.token_streams[r]) for part in self._parts),
                tuple(part.cache.layout.layer_ids for part in self._parts),
                tuple(cells),
                tuple(ev._frozen_array(w[:, k], np.float32) for w in stacked))
        return out


class AttentionProbe:
    """One decode's attention probe: which token of each sequence to watch (its last output token),
    a UbatchProbe for each ubatch that holds one, and the AttentionWeights events once all succeeded."""

    def __init__(self, seq_ids: tuple[tuple[int, ...], ...], output: np.ndarray) -> None:
        self._last = last_outputs(seq_ids, output)
        self._wanted = np.array(sorted(set(self._last.values())), dtype=np.int64)
        self._probes: list[UbatchProbe] = []

    def for_ubatch(self, ubatch: UBatch, attn) -> UbatchProbe | None:
        """The probe to pass to this ubatch's forward pass; None when it holds no watched token."""
        rows = np.flatnonzero(np.isin(ubatch.idxs, self._wanted))
        if not rows.size:
            return None
        probe = UbatchProbe(ubatch, attn, rows)
        self._probes.append(probe)
        return probe

    def events(self, step: int) -> list[ev.AttentionWeights]:
        """One event per sequence, by seq id; sequences sharing a token share its arrays."""
        records: dict[int, tuple] = {}
        for probe in self._probes:
            records.update(probe.records())
        return [ev.AttentionWeights(s, step, i, *records[i]) for s, i in sorted(self._last.items())]
