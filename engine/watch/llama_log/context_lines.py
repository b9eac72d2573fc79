"""The facts llama.cpp prints when it loads a model and builds a context, turned into the engine's records:
a ContextCreated per cache (`llama_context: n_ctx = ...`, `llama_kv_cache: size = ...`, the iSWA pair's
`creating non-SWA / SWA KV cache` lines) and the devices' memory (`model buffer size`, `KV buffer size`,
`compute buffer size`). Sizes in MiB with two or three decimals are all the log gives: bytes are rounded
from them. Source: src/llama-context.cpp, src/llama-kv-cache.cpp, src/llama-kv-cache-iswa.cpp,
src/llama-model.cpp, common/common.cpp.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine import events as ev

MIB = 1 << 20
CONTEXT_START = "llama_context: constructing llama_context"
CONTEXT_PARAM = re.compile(r"llama_context: (\w+) += (.+?)\s*$")
ISWA_CACHE = re.compile(r"llama_kv_cache_iswa: creating +(non-SWA|SWA) KV cache, size = (\d+) cells")
CACHE_LAYER = re.compile(r"llama_kv_cache: layer +(\d+): (?:dev = (\S+)|filtered)")
CACHE_SIZE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
                        r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")
BUFFER = re.compile(r"(load_tensors|llama_kv_cache|sched_reserve|llama_context): +(\S+?)(?:_Mapped)? +"
                    r"(model|KV|compute|output) buffer size = +([\d.]+) MiB")
MODEL_NAME = re.compile(r"(?:llama_model_loader: - kv +\d+: +general\.name str +=|print_info: general\.name +=) (.+?)\s*$")
MODEL_SWA = re.compile(r"print_info: n_swa += (\d+)")
MODEL_LAYERS = re.compile(r"print_info: n_layer += (\d+)")
MODEL_LOAD = "load_tensors: loading model tensors"
DEVICE_FREE = re.compile(r"(?:common_param: +- (\S+) +: .*\((\d+) MiB, (\d+) MiB free\)"
                         r"|using device (\S+) \(.*\) .*- (\d+) MiB free)")
PART = {"model": "weights", "KV": "kv", "compute": "compute", "output": "compute"}
PAD = 256  # llama.cpp pads the cache to 256 cells (llama_kv_cache::get_padding)
HOST = "CPU"  # ggml's name of host memory in the buffer lines


@dataclass
class CacheFacts:
    name: str
    kv_size: int = 0
    layer_ids: list[int] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


class ContextLines:
    """Reads init lines; `line()` answers the events a line completes (none for most)."""

    def __init__(self) -> None:
        self.model_name = ""
        self.model_n_swa = 0
        self.params: dict[str, str] = {}
        self.caches: dict[str, ev.ContextCreated] = {}  # of the current context, in creation order
        self._building: CacheFacts | None = None
        self._lines: list[str] = []
        self.memory: dict[tuple[str, str], int] = {}  # (device, part) -> bytes
        self.capacity: dict[str, int] = {}
        self.host_bytes = (0, 0)  # a server's checkpoints and prompt cache (the parser keeps it up to date)

    def line(self, text: str) -> list[ev.Event] | None:
        """Events for one line; None when the line is not one of these."""
        if text.startswith("llama_context: ") or text.startswith("llama_kv_cache"):
            return self._context_line(text)
        if text.startswith(("print_info: ", "llama_model_loader: ")):
            m = MODEL_NAME.match(text)
            if m:
                self.model_name = m.group(1)
                return []
            m = MODEL_SWA.match(text)
            if m:
                self.model_n_swa = int(m.group(1))
                return []
            return [] if text.startswith("print_info: ") else None
        if text.startswith(MODEL_LOAD):
            for key in [k for k in self.memory if k[1] == "weights"]:
                del self.memory[key]
            return []
        m = BUFFER.match(text)
        if m:
            return self._buffer(m)
        m = DEVICE_FREE.search(text)
        if m:
            device = m.group(1) or m.group(4)
            total = m.group(2) or m.group(5)
            self.capacity[device] = int(total) * MIB
            return []
        return None

    def _context_line(self, text: str) -> list[ev.Event] | None:
        if text.startswith(CONTEXT_START):
            self.params, self.caches, self._building, self._lines = {}, {}, None, [text]
            for key in [k for k in self.memory if k[1] != "weights"]:
                del self.memory[key]
            return []
        m = BUFFER.match(text)
        if m:
            self._lines.append(text)
            return self._buffer(m)
        m = CONTEXT_PARAM.match(text)
        if m:
            self.params[m.group(1)] = m.group(2)
            self._lines.append(text)
            return []
        m = ISWA_CACHE.match(text)
        if m:
            name = "base" if m.group(1) == "non-SWA" else "swa"
            self._building = CacheFacts(name, int(m.group(2)), lines=[text])
            return []
        m = CACHE_LAYER.match(text)
        if m:
            if self._building is None:
                self._building = CacheFacts("kv")
            self._building.lines.append(text)
            if m.group(2):
                self._building.layer_ids.append(int(m.group(1)))
            return []
        m = CACHE_SIZE.match(text)
        if m:
            if self._building is None:
                self._building = CacheFacts("kv")
            self._building.lines.append(text)
            return [self._created(self._building, m)]
        if text.startswith("llama_kv_cache"):
            if self._building is not None:
                self._building.lines.append(text)
            return []
        return None

    def _created(self, facts: CacheFacts, m: re.Match) -> ev.ContextCreated:
        p = self.params
        kv_size, n_layer, n_seq_max, n_stream = int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))
        n_swa = self.model_n_swa if facts.name == "swa" else 0
        created = ev.ContextCreated(
            cache=facts.name, n_ctx=_int(p.get("n_ctx"), kv_size), n_ctx_seq=_int(p.get("n_ctx_seq"), kv_size),
            kv_size=kv_size, n_stream=n_stream, n_seq_max=n_seq_max, n_layer=n_layer, type_k=m.group(6),
            type_v=m.group(8), v_trans=p.get("flash_attn", "") == "disabled",
            k_bytes=round(float(m.group(7)) * MIB), v_bytes=round(float(m.group(9)) * MIB),
            n_batch=_int(p.get("n_batch"), 0), n_ubatch=_int(p.get("n_ubatch"), 0), pad=PAD,
            unified=p.get("kv_unified", "true" if n_stream == 1 else "false") == "true",
            model_name=self.model_name, log_lines=tuple(self._lines + facts.lines),
            layer_ids=tuple(facts.layer_ids), n_swa=n_swa, n_swa_train=n_swa,
            # the log does not print the window's type; every sliding-window model llama.cpp runs with a
            # plain window (gemma2/3, gpt-oss, ...) has LLAMA_SWA_TYPE_STANDARD
            swa_type=1 if n_swa > 0 else 0)
        self.caches[facts.name] = created
        self._building = None
        return created

    def _buffer(self, m: re.Match) -> list[ev.Event]:
        device, part = m.group(2), PART[m.group(3)]
        key = (device, part)
        nbytes = round(float(m.group(4)) * MIB)
        # a context's output and compute buffers add up; the kv caches of an iSWA pair too
        self.memory[key] = self.memory.get(key, 0) + nbytes if part in ("kv", "compute") else nbytes
        return [self.memory_state(*self.host_bytes)]

    def memory_state(self, checkpoints: int = 0, prompt_cache: int = 0) -> ev.DeviceMemoryState:
        """Every device's bytes; a server's checkpoints and prompt cache are host memory (the CPU's row)."""
        devices = sorted({d for d, _ in self.memory} | ({HOST} if checkpoints or prompt_cache else set()))
        return ev.DeviceMemoryState(devices=tuple(
            ev.DeviceBytes(device=d, virtual=False, capacity=self.capacity.get(d), reserved=None,
                           weights=self.memory.get((d, "weights"), 0), kv=self.memory.get((d, "kv"), 0),
                           compute=self.memory.get((d, "compute"), 0),
                           checkpoints=checkpoints if d == HOST else 0,
                           prompt_cache=prompt_cache if d == HOST else 0) for d in devices))


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default
