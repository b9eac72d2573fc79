"""A context: cache sizing from the parameters, and decode (batch -> ubatches -> cache -> model -> logits).

Mirrors llama.cpp's llama_context: the same parameter rounding, the same split strategies, the same
return codes (0 ok, 1 no slot, 2 aborted, -1 invalid batch, -3 compute failure) and the same cleanup
after a failure part-way through a batch.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import events as ev
from engine.arguments import (
    bytes_arg,
    flag_arg,
    int_arg,
    int_array,
    ints,
    list_of,
    number_list,
    optional_int,
    path_arg,
    str_arg,
    str_list,
)
from engine.batch import Batch, BatchAllocator, UBatch
from engine.errors import (
    ArgumentTypeError,
    BatchTooLargeError,
    ContextParamsError,
    InvalidBatchError,
)
from engine.kv import state_files
from engine.kv.attention import AttentionProbe
from engine.kv.factory import build_memory
from engine.kv.memory import Memory
from engine.kv.slot_debug import level_from_env
from engine.kv.state import caches_of
from engine.kv.types import cache_type
from engine.models.model import Model
from engine.models.transformer import DecodeAborted
from engine.placement.context_devices import ContextDevices
from engine.placement.devices import Device
from engine.sizing.memory_breakdown import MemoryBreakdown
from engine.sizing.settings_aliases import (
    check_context_settings,
    context_size,
    gpu_layers,
    with_swa_window,
)

log = logging.getLogger("kvscope.context")

def pad_to(n: int, pad: int) -> int:
    return (n + pad - 1) // pad * pad


@dataclass(frozen=True)
class ContextParams:
    """Resolved sizes, as llama.cpp computes them from the requested parameters."""

    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_stream: int
    kv_unified: bool
    pad: int
    type_k: str
    type_v: str
    flash_attn: str
    v_trans: bool
    swa_full: bool

    @classmethod
    def resolve(cls, *, n_ctx_train: int, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
                kv_unified: bool, pad: int, type_k: str, type_v: str, flash_attn: str,
                swa_full: bool, head_dims: tuple[int, ...] = ()) -> ContextParams:
        """head_dims: the K/V head size of every model layer, for the block-size check of quantized
        cache types (empty: not checked). A quantized V cache turns flash_attn "auto" into "on"."""
        check_context_settings(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max, pad=pad,
                               type_k=type_k, type_v=type_v, flash_attn=flash_attn, head_dims=head_dims)
        n_seq_max = max(1, n_seq_max)
        if cache_type(type_v).is_quantized and flash_attn == "auto":
            flash_attn = "on"  # Context logs llama_init_from_model's line after the model's placement lines
        n_ctx_requested = n_ctx or n_ctx_train
        # llama_context's constructor bounds the batch by the n_ctx as requested, before the memory
        # rounds it up: n_ctx 1 gives 256 cells but n_batch = n_ubatch = 1.
        n_batch = min(n_ctx_requested, n_batch)
        n_ubatch = min(n_batch, n_ubatch)
        n_ctx = pad_to(n_ctx_requested, pad)
        if kv_unified:
            n_ctx_seq = n_ctx
        else:
            n_ctx_seq = pad_to(n_ctx // n_seq_max, pad)
            n_ctx = n_ctx_seq * n_seq_max
        return cls(n_ctx, n_ctx_seq, n_batch, n_ubatch, n_seq_max, 1 if kv_unified else n_seq_max, kv_unified,
                   pad, type_k.lower(), type_v.lower(), flash_attn, flash_attn == "off", swa_full)


@dataclass
class PerfCounters:
    """llama.cpp's llama_perf_context numbers, plus the bytes copied between devices."""

    t_p_eval_ms: float = 0.0
    n_p_eval: int = 0
    t_eval_ms: float = 0.0
    n_eval: int = 0
    n_decode: int = 0
    ubatch_ms: list[float] = field(default_factory=list)
    bytes_moved: int = 0  # copied across device boundaries: activations, and logits to the host
    n_tokens_computed: int = 0  # tokens through the model, for the per-token average
    copy_ms: float = 0.0  # time spent on those copies

    @property
    def bytes_moved_per_token(self) -> float:
        return self.bytes_moved / self.n_tokens_computed if self.n_tokens_computed else 0.0


class Context:
    """Decode batches against a llama.cpp-exact KV cache, publishing every cache change on `bus`."""

    def __init__(self, model: Model, *, n_ctx: int | None = None, n_batch: int = 2048, n_ubatch: int = 512,
                 n_seq_max: int = 1, kv_unified: bool = False, pad: int = 256, type_k: str = "f16",
                 type_v: str = "f16", flash_attn: str = "auto", swa_full: bool = False,
                 abort_callback: Callable[[], bool] | None = None, bus: ev.EventBus | None = None,
                 devices: Sequence[Device | str] | None = None, n_gpu_layers: int | None = None,
                 tensor_split: Sequence[float] | None = None, offload_kqv: bool = True,
                 tensor_overrides: Sequence[str] | None = None, kvsize: int | None = None,
                 swa_window: int | None = None, kv_cache_debug: int | None = None,
                 publish_attention: bool = False, publish_logits: bool = False) -> None:
        """devices: the GPUs to offload to (None: the real ones found; see engine.placement.devices.resolve_gpus),
        n_gpu_layers/tensor_split/offload_kqv/tensor_overrides as llama.cpp's -ngl/-ts/-kvo/-ot
        ("REGEX=DEVICE" items; see engine.placement.weight_devices). Each layer's K/V and, when anything is
        offloaded, each weight goes to its device. Weights are shared by the model's contexts, so a
        context whose placement differs from a live one's is refused.

        Names from llama.cpp articles (engine.sizing.settings_aliases): kvsize is n_ctx (default 512, llama.cpp's
        library default; 0: n_ctx_train); n_gpu_layers defaults to $LLAMA_OFFLOAD_LAYERS, else 0;
        swa_window replaces a sliding-window model's window for the caches. kv_cache_debug: llama.cpp's
        LLAMA_KV_CACHE_DEBUG level for the slot-search dump (None: the environment variable).
        publish_attention: after each decode, publish an AttentionWeights event per sequence with an output
        token (its last one's attention over the cells, per layer, head-averaged) while anyone listens.
        publish_logits: after each decode, publish an OutputLogProbs event with every output's next-token
        log-probabilities (what an A/B comparison of two contexts reads) while anyone listens."""
        if not isinstance(model, Model):
            raise ArgumentTypeError(f"Context: model must be an engine.Model (from engine.load_model), got "
                                    f"{type(model).__name__}")
        n_ctx, kvsize, n_gpu_layers, swa_window, kv_cache_debug = (
            optional_int(v, name, "Context") for name, v in (("n_ctx", n_ctx), ("kvsize", kvsize),
                                                             ("n_gpu_layers", n_gpu_layers), ("swa_window", swa_window),
                                                             ("kv_cache_debug", kv_cache_debug)))
        n_batch, n_ubatch, n_seq_max, pad = ints("Context", n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                                                 pad=pad)
        kv_unified, swa_full, offload_kqv, publish_attention, publish_logits = (flag_arg(v, name, "Context") for name, v in (
            ("kv_unified", kv_unified), ("swa_full", swa_full), ("offload_kqv", offload_kqv),
            ("publish_attention", publish_attention), ("publish_logits", publish_logits)))
        type_k, type_v, flash_attn = (str_arg(v, name, "Context") for name, v in (
            ("type_k", type_k), ("type_v", type_v), ("flash_attn", flash_attn)))
        if devices is not None:
            devices = list_of(devices, "devices", "Context", item="a device name ('CUDA0', 'VGPU0=2GiB') or an "
                              "engine.placement.devices.Device", ok=lambda d: isinstance(d, (str, Device)))
        tensor_split = None if tensor_split is None else number_list(tensor_split, "tensor_split", "Context")
        if tensor_overrides is not None:
            tensor_overrides = str_list(tensor_overrides, "tensor_overrides", "Context")
        if bus is not None and not isinstance(bus, ev.EventBus):
            raise ArgumentTypeError(f"Context: bus must be an engine.EventBus or None, got {type(bus).__name__}")
        if abort_callback is not None and not callable(abort_callback):
            raise ArgumentTypeError(f"Context: abort_callback must be callable or None, got {abort_callback!r}")
        n_ctx, n_gpu_layers = context_size(n_ctx, kvsize), gpu_layers(n_gpu_layers)
        # read before anything is placed or reserved, so that a bad value leaves no trace
        kv_cache_debug = level_from_env() if kv_cache_debug is None else kv_cache_debug
        self.cache_config = with_swa_window(model.config, swa_window)  # what the caches are sized and masked by
        cfg = self.cache_config
        self.model = model
        self.params = ContextParams.resolve(
            n_ctx_train=cfg.n_ctx_train, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
            kv_unified=kv_unified, pad=pad, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
            swa_full=swa_full, head_dims=(cfg.head_dim,) * cfg.n_layer)
        self.bus = bus if bus is not None else ev.EventBus()
        self.abort_callback = abort_callback
        self.publish_attention = publish_attention
        self.publish_logits = publish_logits
        self.perf = PerfCounters()
        p = self.params
        self.devices = ContextDevices(model, cfg, p, devices=devices, n_gpu_layers=n_gpu_layers,
                                      tensor_split=tensor_split, offload_kqv=offload_kqv,
                                      tensor_overrides=tensor_overrides)  # refuses what does not fit
        self.devices.commit(self, self.bus)
        if p.flash_attn != flash_attn:
            log.info("llama_init_from_model: enabling flash_attn since it is required for quantized V cache")
        self.placement, self.gpus = self.devices.placement, self.devices.gpus
        self.weight_devices, self.weights = self.devices.weight_devices, self.devices.weights
        # bytes per device: model weights, K/V and compute buffers; and the weights this context placed
        self.model_bytes_by_device, self.kv_bytes_by_device = self.devices.model_bytes, self.devices.kv_bytes
        self.compute_bytes_by_device = self.devices.compute_bytes
        self.weight_bytes_by_device = self.devices.placed_weight_bytes
        try:
            self.memory: Memory = build_memory(cfg, p, bus=self.bus, key_shifter=model.transformer.rotary.shift_keys,
                                               kv_devices=self.placement.kv_devices, kv_cache_debug=kv_cache_debug)
        except (RuntimeError, MemoryError) as e:  # torch could not allocate the K/V buffers after all
            self.devices.undo()
            raise ContextParamsError(f"the KV cache could not be allocated ({e}); nothing was kept: use a smaller "
                                     f"n_ctx (-c) or a quantized cache type (-ctk/-ctv)") from e
        records = [(logging.INFO, line) for line in self._context_log_lines()] + self.memory.init_log_records()
        self.init_log_lines = [line for level, line in records if level == logging.INFO]
        for level, line in records + [(logging.INFO, line) for line in self.memory_breakdown_lines()]:
            log.log(level, "%s", line)
        self._logits: torch.Tensor | None = None
        self._output_batch_idx: np.ndarray = np.zeros(0, dtype=np.int64)
        self.last_error = ""
        self.n_steps = 0  # decodes that passed validation: DecodeStarted.step numbers them
        if self.bus.active:
            for event in self._created_events() + [self._vocabulary_event()]:
                self.bus.publish(event)
        self.bus.add_state_source(self.state_events)

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.params.n_ctx

    @property
    def n_batch(self) -> int:
        return self.params.n_batch

    @property
    def n_ubatch(self) -> int:
        return self.params.n_ubatch

    @property
    def n_seq_max(self) -> int:
        return self.params.n_seq_max

    def _context_log_lines(self) -> list[str]:
        p, cfg = self.params, self.model.config
        lines = [
            "llama_context: constructing llama_context",
            f"llama_context: n_seq_max     = {p.n_seq_max}",
            f"llama_context: n_ctx         = {p.n_ctx}",
            f"llama_context: n_ctx_seq     = {p.n_ctx_seq}",
            f"llama_context: n_batch       = {p.n_batch}",
            f"llama_context: n_ubatch      = {p.n_ubatch}",
            "llama_context: causal_attn   = 1",
            f"llama_context: flash_attn    = {p.flash_attn}",
            f"llama_context: kv_unified    = {'true' if p.kv_unified else 'false'}",
            f"llama_context: freq_base     = {cfg.rope_theta:.1f}",
            "llama_context: freq_scale    = 1",
        ]
        if self.cache_config.n_swa != cfg.n_swa:
            lines.append(f"llama_context: n_swa = {self.cache_config.n_swa} replaces the model's sliding window of "
                         f"{cfg.n_swa}, which it was trained with")
        if p.n_ctx_seq < cfg.n_ctx_train:
            lines.append(f"llama_context: n_ctx_seq ({p.n_ctx_seq}) < n_ctx_train ({cfg.n_ctx_train}) -- "
                         "the full capacity of the model will not be utilized")
        elif p.n_ctx_seq > cfg.n_ctx_train:
            lines.append(f"llama_context: n_ctx_seq ({p.n_ctx_seq}) > n_ctx_train ({cfg.n_ctx_train}) -- "
                         "possible training context overflow")
        return lines

    def _created_events(self) -> list[ev.ContextCreated]:
        p = self.params
        return [ev.ContextCreated(
            cache=cache.name, n_ctx=p.n_ctx, n_ctx_seq=p.n_ctx_seq, kv_size=cache.size,
            n_stream=cache.n_stream, n_seq_max=p.n_seq_max, n_layer=len(cache.layout.layer_ids), type_k=p.type_k,
            type_v=p.type_v, v_trans=p.v_trans, k_bytes=cache.k_bytes(), v_bytes=cache.v_bytes(),
            n_batch=p.n_batch, n_ubatch=p.n_ubatch, pad=p.pad, unified=p.kv_unified,
            model_name=self.model.name, log_lines=tuple(self.init_log_lines), layer_ids=cache.layout.layer_ids,
            n_swa=cache.layout.n_swa, swa_type=int(cache.layout.swa_type),
            n_swa_train=self.model.config.n_swa if cache.layout.n_swa else 0) for cache in self.memory.caches()]

    # ---- memory ----------------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[Device, MemoryBreakdown]:
        """Bytes per device of model weights, context (KV cache) and compute buffers, like llama.cpp's
        llama_context::memory_breakdown(); every GPU of the context is listed, zeros included."""
        return self.devices.breakdown()

    def memory_breakdown_lines(self) -> list[str]:
        """llama_memory_breakdown_print's table, with each GPU's total and free memory as of now."""
        return self.devices.breakdown_lines()

    def state_events(self) -> list[ev.Event]:
        """The context as events: where the model is, what each device holds, ContextCreated and a full
        MemorySnapshot per cache. The bus gives them to every watcher that subscribes (EventBus.subscribe)."""
        return (self.devices.state_events() + self._created_events() + [self._vocabulary_event()]
                + self.memory.snapshot_events())

    def _vocabulary_event(self) -> ev.Vocabulary:
        return ev.Vocabulary(self.model.name, self.model.token_pieces())

    def publish_state(self) -> None:
        """Publish state_events() to every watcher, e.g. to resync one that lost events."""
        if self.bus.active:
            for event in self.state_events():
                self.bus.publish(event)

    # ---- decode -----------------------------------------------------------------------------
    def decode(self, batch: Batch) -> int:
        """Decode a batch. Returns 0, 1 (no KV slot), 2 (aborted), -1 (invalid batch) or -3 (failure)."""
        t0 = time.perf_counter()
        n = len(batch.tokens)
        if n > self.params.n_batch:
            raise BatchTooLargeError(
                f"decode: the batch has {n} tokens but n_batch = {self.params.n_batch}; split it or create the "
                f"context with a larger n_batch")
        self._logits = None
        try:
            alloc = BatchAllocator(batch, n_vocab=self.model.n_vocab, n_seq_max=self.params.n_seq_max,
                                   memory=self.memory)
        except InvalidBatchError as e:
            return self._fail(-1, f"{e}\ndecode: failed to initialize batch", n, t0)
        self.n_steps += 1
        if self.bus.active:
            self.bus.publish(ev.DecodeStarted(n, alloc.n_outputs, alloc.seq_id_unq, step=self.n_steps - 1))
        self.memory.update()
        plan = self.memory.init_batch(alloc, self.params.n_ubatch)
        if plan is None:
            return self._fail(1, f"decode: failed to find a memory slot for batch of size {n}", n, t0)
        ubatches, slots = plan
        return self._run_ubatches(alloc, ubatches, slots, t0)

    def _run_ubatches(self, alloc: BatchAllocator, ubatches, slots, t0: float) -> int:
        transformer = self.model.transformer
        # computed only while someone listens, as every event is
        probe = AttentionProbe(alloc.seq_ids, alloc.output) if self.publish_attention and self.bus.active else None
        out_idx, out_logits, ms = [], [], []
        for k, (ub, sinfo) in enumerate(zip(ubatches, slots)):
            tu = time.perf_counter()
            self.memory.apply_ubatch(sinfo, ub, ubatch_index=k)
            attn = self.memory.attention_inputs(sinfo, ub)
            rows = np.flatnonzero(ub.output)
            moved, copy_s = transformer.bytes_moved, transformer.copy_seconds
            ub_probe = None if probe is None else probe.for_ubatch(ub, attn)
            try:
                logits = transformer.forward(torch.from_numpy(ub.tokens), torch.from_numpy(ub.pos), attn,
                                             torch.from_numpy(rows), self.abort_callback, probe=ub_probe)
            except DecodeAborted:
                self._remove_failed_ubatch(ub)
                return self._fail(2, "decode: aborted by the abort callback", alloc.n_tokens, t0, ubatches)
            except RuntimeError as e:
                self._remove_failed_ubatch(ub)
                return self._fail(-3, f"decode: compute failed: {e}", alloc.n_tokens, t0, ubatches)
            self.perf.bytes_moved += transformer.bytes_moved - moved
            self.perf.copy_ms += (transformer.copy_seconds - copy_s) * 1e3
            self.perf.n_tokens_computed += ub.n_tokens
            out_idx.append(ub.idxs[rows])
            out_logits.append(logits)
            ms.append((time.perf_counter() - tu) * 1e3)
        idx = np.concatenate(out_idx)
        order = np.argsort(idx, kind="stable")
        self._output_batch_idx = idx[order]
        # usually one ubatch in batch order: then the forward's logits are kept as they are, not copied
        logits = out_logits[0] if len(out_logits) == 1 else torch.cat(out_logits)
        in_order = bool(np.all(order[1:] > order[:-1]))
        self._logits = logits if in_order else logits[torch.from_numpy(order)]
        if probe is not None:  # inside the step and its time: DecodeFinished still closes it
            for event in probe.events(self.n_steps - 1):
                self.bus.publish(event)
        if self.publish_logits and self.bus.active:
            self._publish_logprobs(alloc)
        self._account(alloc.n_tokens, t0, ms)
        if self.bus.active:
            self.bus.publish(ev.DecodeFinished(0, alloc.n_tokens, tuple(u.n_tokens for u in ubatches),
                                               (time.perf_counter() - t0) * 1e3, tuple(ms)))
        return 0

    def _publish_logprobs(self, alloc: BatchAllocator) -> None:
        batch_idx = self._output_batch_idx.tolist()
        logprobs = torch.log_softmax(self._logits.float(), dim=-1).cpu().numpy()
        self.bus.publish(ev.OutputLogProbs(self.n_steps - 1, tuple(min(alloc.seq_ids[i]) for i in batch_idx),
                                           tuple(int(alloc.pos[i]) for i in batch_idx), logprobs))

    def _remove_failed_ubatch(self, ub: UBatch) -> None:
        """llama.cpp's cleanup (llama_context::decode, src/llama-context.cpp): each sequence of the failed ubatch loses its cells from the ubatch's
        smallest position of that sequence on. Only each token's FIRST seq id counts (llama.cpp keys
        pos_min by ubatch.seq_id[i][0]), so the other seqs of a coupled token keep those cells."""
        p_min: dict[int, int] = {}
        for ids, pos in zip(ub.seq_ids, ub.pos):
            p_min[ids[0]] = min(p_min.get(ids[0], int(pos)), int(pos))
        for s, p in sorted(p_min.items()):
            log.warning("decode: removing memory module entries for seq_id = %d, pos = [%d, +inf)", s, p)
            self.memory.seq_rm(s, p, -1, reason="failure_cleanup")

    def _fail(self, rc: int, message: str, n_tokens: int, t0: float, ubatches=None) -> int:
        self.last_error = message
        (log.error if rc < 0 else log.warning)("%s", message)
        if rc != 1:
            log.error("llama_decode: failed to decode, ret = %d", rc)
        if self.bus.active:
            sizes = tuple(u.n_tokens for u in ubatches) if ubatches else ()
            self.bus.publish(ev.DecodeFinished(rc, n_tokens, sizes, (time.perf_counter() - t0) * 1e3,
                                               message=message))
        return rc

    def _account(self, n_tokens: int, t0: float, ubatch_ms: list[float]) -> None:
        dt = (time.perf_counter() - t0) * 1e3
        perf = self.perf
        perf.n_decode += 1
        if n_tokens > 1:
            perf.t_p_eval_ms += dt
            perf.n_p_eval += n_tokens
        else:
            perf.t_eval_ms += dt
            perf.n_eval += 1
        perf.ubatch_ms = ubatch_ms

    # ---- outputs -------------------------------------------------------------------------------
    @property
    def n_outputs(self) -> int:
        return 0 if self._logits is None else self._logits.shape[0]

    def logits(self, i: int = -1) -> torch.Tensor:
        """Logits row of the i-th output token of the last decode (batch order; negative from the end)."""
        if self._logits is None:
            raise IndexError("no logits: the last decode failed or produced no outputs")
        n = self._logits.shape[0]
        if not -n <= i < n:
            raise IndexError(f"output {i} out of range: the last decode produced {n} output(s)")
        return self._logits[i]

    def logits_for_token(self, batch_index: int) -> torch.Tensor:
        """Logits of the batch token at batch_index (llama_get_logits_ith); it must have been an output."""
        if self._logits is None:
            raise IndexError("no logits: the last decode failed or produced no outputs")
        hits = np.flatnonzero(self._output_batch_idx == batch_index)
        if not hits.size:
            raise IndexError(f"batch token {batch_index} was not marked as an output (logits=True)")
        return self._logits[int(hits[0])]

    def all_logits(self) -> torch.Tensor:
        if self._logits is None:
            raise IndexError("no logits: the last decode failed or produced no outputs")
        return self._logits

    # ---- state save/restore (llama.h llama_state_*; format and failure rules: engine/kv/state.py) ----
    # Arguments are checked here, before the state code reads or changes anything.
    def state_get_data(self) -> bytes:
        """llama_state_get_data: the model arch and the state of the whole memory."""
        return state_files.context_state_bytes(self.model.config.arch, caches_of(self.memory))

    def state_get_size(self) -> int:
        return len(self.state_get_data())

    def state_set_data(self, data: bytes) -> int:
        """llama_state_set_data: replace the whole memory; returns the bytes read. Raises
        engine.kv.state.StateFileError (the memory is then left as llama_kv_cache::state_read leaves it)."""
        data = bytes_arg(data, "data", "state_set_data")
        return state_files.restore_context_state(self.model.config.arch, caches_of(self.memory), data)

    def state_seq_get_data(self, seq_id: int, flags: int = 0) -> bytes:
        """llama_state_seq_get_data(_ext): the state of one sequence (flags: STATE_SEQ_FLAGS_*)."""
        seq_id, flags = ints("state_seq_get_data", seq_id=seq_id, flags=flags)
        return state_files.seq_state_bytes(caches_of(self.memory, flags), seq_id)

    def state_seq_get_size(self, seq_id: int, flags: int = 0) -> int:
        return len(self.state_seq_get_data(seq_id, flags))

    def state_seq_set_data(self, data: bytes, dest_seq_id: int, flags: int = 0) -> int:
        """llama_state_seq_set_data(_ext): load a sequence state into dest_seq_id (the saved id is
        ignored); returns the bytes read."""
        data = bytes_arg(data, "data", "state_seq_set_data")
        dest_seq_id, flags = ints("state_seq_set_data", dest_seq_id=dest_seq_id, flags=flags)
        return state_files.restore_seq_state(caches_of(self.memory, flags), data, dest_seq_id)

    def state_save_file(self, path, tokens) -> int:
        """llama_state_save_file ('ggsn' session file with the tokens); returns the file size."""
        path, tokens = path_arg(path, "path", "state_save_file"), int_array(tokens, "tokens", "state_save_file")
        return state_files.save_session_file(path, self.model.config.arch, caches_of(self.memory), tokens)

    def state_load_file(self, path, n_token_capacity: int | None = None) -> list[int]:
        """llama_state_load_file: restore the whole memory; returns the saved tokens."""
        path = path_arg(path, "path", "state_load_file")
        n_token_capacity = optional_int(n_token_capacity, "n_token_capacity", "state_load_file")
        return state_files.load_session_file(path, self.model.config.arch, caches_of(self.memory),
                                             n_token_capacity)

    def state_seq_save_file(self, path, seq_id: int, tokens) -> int:
        """llama_state_seq_save_file ('ggsq' file with the tokens); returns the file size."""
        path, tokens = path_arg(path, "path", "state_seq_save_file"), int_array(tokens, "tokens", "state_seq_save_file")
        seq_id = int_arg(seq_id, "seq_id", "state_seq_save_file")
        return state_files.save_seq_file(path, caches_of(self.memory), seq_id, tokens)

    def state_seq_load_file(self, path, dest_seq_id: int, n_token_capacity: int | None = None) -> list[int]:
        """llama_state_seq_load_file: restore a sequence into dest_seq_id; returns the saved tokens."""
        path = path_arg(path, "path", "state_seq_load_file")
        dest_seq_id = int_arg(dest_seq_id, "dest_seq_id", "state_seq_load_file")
        n_token_capacity = optional_int(n_token_capacity, "n_token_capacity", "state_seq_load_file")
        return state_files.load_seq_file(path, caches_of(self.memory), dest_seq_id, n_token_capacity)
