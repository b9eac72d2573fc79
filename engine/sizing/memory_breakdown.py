"""llama.cpp's memory breakdown: bytes of model weights, context (KV cache) and compute buffers per
device, and the table `llama_memory_breakdown_print` writes (src/llama-context.cpp).

The table, as llama.cpp lays it out: one row per GPU the context may use,
`total = free + (self = model + context + compute) + unaccounted`, then a `Host` row with self,
model, context and compute. Values are whole MiB, rounded down. Column 1 is padded on the right,
the others on the left, each to its widest cell. kvscope's virtual devices are GPUs here, with
"virtual, host memory" as their description; their total is the capacity given, their free what
no context has reserved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.placement.devices import Device

MIB = 1 << 20
_HEADER = "{0}: | {1} | {2}   {3}    {4}   {5}   {6}   {7}    {8} |"
_GPU = "{0}: | {1} | {2} = {3} + ({4} = {5} + {6} + {7}) + {8} |"
_OTHER = "{0}: | {1} | {2}   {3}    {4} = {5} + {6} + {7}    {8} |"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one device (llama.cpp: one buffer type) holds for a context."""

    model: int = 0
    context: int = 0
    compute: int = 0

    @property
    def self_bytes(self) -> int:
        return self.model + self.context + self.compute


def breakdown_by_device(model: dict[Device, int], context: dict[Device, int], compute: dict[Device, int],
                        devices: Sequence[Device]) -> dict[Device, MemoryBreakdown]:
    """Every device in `devices` (with zeros where it holds nothing) and any other that holds bytes."""
    out = {d: MemoryBreakdown() for d in devices}
    for dev in {**model, **context, **compute}:
        out[dev] = MemoryBreakdown(model.get(dev, 0), context.get(dev, 0), compute.get(dev, 0))
    return out


def breakdown_table(rows: dict[Device, MemoryBreakdown], gpus: Sequence[Device]) -> list[str]:
    """The table's lines. gpus: the context's GPUs, in order; everything else goes to the Host row
    (the CPU) or, if it is neither, a row of its own."""
    def mib(n: int) -> str:
        return str(n // MIB)

    table = [(_HEADER, "memory breakdown [MiB]", "total", "free", "self", "model", "context", "compute",
              "unaccounted")]
    for dev in gpus:
        mb = rows.get(dev, MemoryBreakdown())
        total, free = dev.total_bytes(), dev.free_bytes()
        if total is None or free is None:  # a device that cannot tell (MPS): no total/free columns
            table.append((_OTHER, f"  - {dev.name} ({dev.description()})", "", "", mib(mb.self_bytes),
                          mib(mb.model), mib(mb.context), mib(mb.compute), ""))
            continue
        table.append((_GPU, f"  - {dev.name} ({dev.description()})", mib(total), mib(free), mib(mb.self_bytes),
                      mib(mb.model), mib(mb.context), mib(mb.compute), mib(total - mb.self_bytes - free)))
    gpu_names = {d.name for d in gpus}
    host = next((mb for d, mb in rows.items() if d.kind == "cpu"), MemoryBreakdown())
    table.append((_OTHER, "  - Host", "", "", mib(host.self_bytes), mib(host.model), mib(host.context),
                  mib(host.compute), ""))
    for dev, mb in rows.items():
        if dev.kind != "cpu" and dev.name not in gpu_names and mb.self_bytes:
            table.append((_OTHER, f"  - {dev.name}", "", "", mib(mb.self_bytes), mib(mb.model), mib(mb.context),
                          mib(mb.compute), ""))
    widths = [max(len(row[j]) for row in table) for j in range(1, 9)]
    lines = []
    for template, *cells in table:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        lines.append(template.format("llama_memory_breakdown_print", *padded))
    return lines
