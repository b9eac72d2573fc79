"""Compute buffers and llama.cpp's memory breakdown (llama_memory_breakdown_print, src/llama-context.cpp):
per device, model + context + compute, the table's layout, and the compute bound against what a decode
really takes."""
from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import engine
from engine.cli import main
from engine.errors import ContextParamsError
from engine.placement.devices import CPU, Device, plan_placement, virtual_device
from engine.placement.weight_devices import all_on_cpu, plan_weight_devices
from engine.sizing.compute_memory import compute_bytes_by_device
from engine.sizing.memory_breakdown import MemoryBreakdown, breakdown_table
from tests.model_factory import in_memory_model, tiny_config

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FakeGpu:
    """A device that reports a given total and free memory, as a driver would."""

    name: str
    desc: str
    total: int
    free: int
    kind: str = "cuda"

    def total_bytes(self) -> int:
        return self.total

    def free_bytes(self) -> int:
        return self.free

    def description(self) -> str:
        return self.desc


def test_table_is_laid_out_as_llama_cpp_prints_it():
    """The figures of a breakdown llama.cpp printed for an RTX 5090 (values in MiB, from bytes that
    round down to them), laid out character for character."""
    gpu = FakeGpu("CUDA0", "RTX 5090", total=int(32606.2 * MIB), free=int(1057.2 * MIB))
    host = type("Host", (), {"kind": "cpu", "name": "CPU"})()
    rows = {gpu: MemoryBreakdown(int(28609.5 * MIB), int(397.4 * MIB), int(358.3 * MIB)),
            host: MemoryBreakdown(int(30940.3 * MIB), 0, int(16.2 * MIB))}
    assert breakdown_table(rows, [gpu]) == [
        "llama_memory_breakdown_print: | memory breakdown [MiB] | total   free     self   model   context   compute"
        "    unaccounted |",
        "llama_memory_breakdown_print: |   - CUDA0 (RTX 5090)   | 32606 = 1057 + (29365 = 28609 +     397 +     358)"
        " +        2183 |",
        "llama_memory_breakdown_print: |   - Host               |                 30956 = 30940 +       0 +      16"
        "                |",
    ]


def test_a_context_breakdown_adds_up_and_shows_other_contexts_as_unaccounted():
    model = engine.load_model("demo")
    gpu = virtual_device("VGPU0=256MiB")
    first = engine.Context(model, n_ctx=512, devices=[gpu], n_gpu_layers=4)
    second = engine.Context(model, n_ctx=256, devices=[gpu], n_gpu_layers=4)
    bd = second.memory_breakdown()
    assert bd[gpu] == MemoryBreakdown(second.model_bytes_by_device[gpu], second.kv_bytes_by_device[gpu],
                                      second.compute_bytes_by_device[gpu])
    assert bd[CPU].context == second.kv_bytes_by_device[CPU] and bd[CPU].model == second.model_bytes_by_device[CPU]
    gpu_row = second.memory_breakdown_lines()[1]
    total, free, self_, model_mib, ctx_mib, compute_mib, unaccounted = map(int, re.findall(r"\d+", gpu_row)[1:])
    assert (total, free) == (256, gpu.free_bytes() // MIB)
    assert self_ == bd[gpu].self_bytes // MIB and compute_mib == bd[gpu].compute // MIB
    # the first context's cache and compute buffers are on the device but not this context's
    others = first.kv_bytes_by_device[gpu] + first.compute_bytes_by_device[gpu]
    assert unaccounted == (gpu.capacity - bd[gpu].self_bytes - gpu.free_bytes()) // MIB == others // MIB
    del first, second
    gc.collect()


def test_every_gpu_of_the_context_gets_a_row_even_an_empty_one():
    model = in_memory_model(n_layer=2)
    ctx = engine.Context(model, n_ctx=256, devices=["VGPU0=64MiB", "VGPU1=64MiB"], n_gpu_layers=1)
    lines = ctx.memory_breakdown_lines()
    assert [re.search(r"- (\S+)", line).group(1) for line in lines[1:]] == ["VGPU0", "VGPU1", "Host"]
    assert "VGPU0 (virtual, host memory)" in lines[1]
    assert re.search(r"\(\s+0 =\s+0 \+\s+0 \+\s+0\)", lines[2])  # VGPU1 holds nothing with -ngl 1


def test_compute_bound_by_hand():
    """One layer: the attention phase is the peak (hand-computed from the shapes). On the host the
    fused CPU kernel holds a block of scores per thread; on a GPU all scores and probabilities."""
    cfg = tiny_config(n_layer=1, n_embd=32, n_head=4, n_head_kv=2, head_dim=8, n_ff=64, n_vocab=64)
    T, n_kv, s = 16, 256, 4
    residual = 3 * T * 32 * s
    attention = T * (32 + 2 * 16) * s + 2 * n_kv * 16 * s + T * n_kv * (1 + s) + T * 32 * s
    projections = T * (32 + 2 * 16) * s + T * (32 + 32) * s
    fused_block = 2 * torch.get_num_threads() * min(T * n_kv, 256 * 512) * 4
    got = compute_bytes_by_device(cfg, all_on_cpu(cfg), T, 1, {0: n_kv}, torch.float32)
    assert got == {CPU: residual + attention + fused_block + projections}

    cuda = Device("CUDA0", "cuda", torch.device("cuda", 0))  # sizes only: nothing is allocated
    on_gpu = plan_weight_devices(cfg, plan_placement(1, -1, [cuda]))
    got = compute_bytes_by_device(cfg, on_gpu, T, 1, {0: n_kv}, torch.float32)
    assert got[cuda] == residual + attention + 2 * 4 * T * n_kv * s + projections
    # scores grow with the tokens and the cells; split streams read K/V once per stream
    bigger = compute_bytes_by_device(cfg, on_gpu, 2 * T, 1, {0: 2 * n_kv}, torch.float32)
    assert bigger[cuda] > 3 * got[cuda]
    two_streams = compute_bytes_by_device(cfg, on_gpu, T, 2, {0: n_kv}, torch.float32)
    assert two_streams[cuda] - got[cuda] == 2 * n_kv * 16 * s


def test_compute_buffers_that_do_not_fit_are_refused():
    model = in_memory_model(n_layer=2)
    probe_gpu = virtual_device("VGPU0=1GiB")
    probe = engine.Context(model, n_ctx=1024, n_ubatch=1024, devices=[probe_gpu], n_gpu_layers=-1)
    weights, kv = probe.weight_bytes_by_device[probe_gpu], probe.kv_bytes_by_device[probe_gpu]
    compute = probe.compute_bytes_by_device[probe_gpu]
    del probe
    gc.collect()
    gpu = virtual_device(f"VGPU0={weights + kv + compute - 1}B")
    with pytest.raises(ContextParamsError, match=f"and compute buffers \\({compute} bytes\\) need"):
        engine.Context(model, n_ctx=1024, n_ubatch=1024, devices=[gpu], n_gpu_layers=-1)
    assert gpu.reserved_bytes() == 0
    # a smaller ubatch needs smaller compute buffers: the same device takes it
    ctx = engine.Context(model, n_ctx=1024, n_ubatch=128, devices=[gpu], n_gpu_layers=-1)
    assert ctx.compute_bytes_by_device[gpu] < compute and gpu.reserved_bytes() <= gpu.capacity


MEASURE = textwrap.dedent("""
    import gc, torch, engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model
    torch.set_num_threads(1)
    T = {T}
    model = in_memory_model(n_layer=2, n_embd=256, n_head=8, n_head_kv=2, head_dim=32, n_ff={n_ff}, n_vocab=2000,
                            n_ctx_train=T)

    def worst_case_decode():  # T tokens over a cache of T cells, every token an output
        ctx = engine.Context(model, n_ctx=T, n_batch=T, n_ubatch=T, type_k="f32", type_v="f32")
        for cache in ctx.memory.caches():  # make the cache's pages resident before measuring
            for rows in cache.k + cache.v:
                rows.data.fill_(0)
        return ctx, lambda: ctx.decode(Batch.for_sequence([1] * T, 0, 0, all_logits=True))

    def peak_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    warm, run = worst_case_decode()
    run()  # the first decode of a process also maps library code: not activation memory
    del warm, run
    gc.collect()
    ctx, run = worst_case_decode()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident size
    before = peak_kib()
    run()
    print((peak_kib() - before) * 1024, ctx.compute_bytes_by_device[ctx.placement.output_device])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc/self/clear_refs and VmHWM")
@pytest.mark.parametrize("n_ff", [512, 4096])
def test_compute_bound_covers_what_a_worst_case_decode_takes(n_ff):
    """A process decodes n_ubatch tokens over a cache of as many cells: its peak memory growth stays
    under the bound, and the bound is not loose (with a wide MLP the MLP phase is the peak, with a
    narrow one the output layer and attention are). Large blocks are mmapped (fixed threshold) so
    that freed memory leaves the resident set and is not silently reused."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", MEASURE.format(T=1024, n_ff=n_ff)], capture_output=True, text=True,
                         check=True, cwd=str(ROOT), env=env).stdout
    measured, bound = map(int, out.split())
    assert bound * 0.5 <= measured <= bound


def test_cli_prints_the_breakdown_after_load_and_at_exit_when_verbose(tiny_llama_gguf, capsys):
    argv = ["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-c", "256", "--temp", "0",
            "--virtual-gpu", "VGPU0=64MiB", "-ngl", "all"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("llama_memory_breakdown_print: | memory breakdown [MiB]") == 1
    assert re.search(r"llama_memory_breakdown_print: \|   - VGPU0 \(virtual, host memory\) \|\s+64 =", err)
    level = logging.getLogger("kvscope").level
    assert main(argv + ["-v"]) == 0
    assert capsys.readouterr().err.count("memory breakdown [MiB]") == 2
    assert logging.getLogger("kvscope").level == level  # -v in-process does not outlive the command
