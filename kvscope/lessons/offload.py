"""Notebook 6, Offload and quantized caches: the plumbing and the checks behind its cells.

The notebook places the demo model on virtual GPUs with llama.cpp's flags (-ngl, -ot, -ts, -nkvo), compares
kvscope's estimate from the file's headers with what the context allocated, and measures quantized K/V caches:
their bytes against ggml's block layouts, and what they cost in next-token distributions. The asserts here keep
its sentences true; the tables are what it prints.
"""
from __future__ import annotations

import os

import numpy as np

import engine
from engine import events as ev
from engine.placement.devices import plan_placement, resolve_gpus
from engine.sizing.estimate import Estimate
from engine.sizing.settings_aliases import OFFLOAD_LAYERS_ENV, gpu_layers

MiB = 2**20
# ggml's block layouts (ggml/src/ggml-common.h): (values, bytes) per block of each cache type
BLOCK = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22),
         "q4_1": (32, 20), "iq4_nl": (32, 18), "q4_0": (32, 18)}
CACHE_TYPES = list(BLOCK)


# ---- -ngl -------------------------------------------------------------------------------------------------
def check_default_gpu_layers() -> int:
    """kvscope's -ngl default: 0 (nothing offloaded), unless $LLAMA_OFFLOAD_LAYERS says otherwise; llama.cpp's is
    auto (-1 in common/common.h), which --fit lowers from every layer until the model fits."""
    if os.environ.get(OFFLOAD_LAYERS_ENV, "").strip():
        return gpu_layers(None)  # the reader's own default: nothing to check
    assert gpu_layers(None) == 0
    return 0


def layer_letters(n_layer: int, ngl: int, gpus) -> str:
    """The layers' devices and the output layer's, as the explorers' layer map writes it: C (CPU) or G (a GPU)."""
    plan = plan_placement(n_layer, ngl, gpus)
    layers = "".join("G" if d.is_gpu else "C" for d in plan.layer_devices)
    return f"{layers} + {'G' if plan.output_device.is_gpu else 'C'}"


def ngl_table(n_layer: int, devices: list[str]) -> str:
    """For every -ngl from 0 to n_layer + 1: where the layers and the output layer go, and llama.cpp's last
    load_tensors line; checked against llama.cpp's rule (the last ngl of the n_layer + 1 layers, the output
    layer counted as the last one)."""
    gpus = resolve_gpus(devices)
    lines = [f"{'-ngl':>4}  layers 0-{n_layer - 1} + output   llama.cpp's log"]
    for ngl in range(n_layer + 2):
        plan = plan_placement(n_layer, ngl, gpus)
        on_gpu = [il for il, d in enumerate(plan.layer_devices) if d.is_gpu]
        assert on_gpu == list(range(max(0, n_layer + 1 - ngl), n_layer)), (ngl, on_gpu)
        assert plan.output_device.is_gpu == (ngl >= 1)
        lines.append(f"{ngl:>4}  {layer_letters(n_layer, ngl, gpus):<20}  {plan.info_log_lines()[-1]}")
    return "\n".join(lines)


def full_offload_log(n_layer: int, devices: list[str]) -> list[str]:
    """llama.cpp's load_tensors lines for -ngl all: it reports n_layer - 1 repeating layers although it
    offloaded all n_layer (one of them is counted as the output layer), and kvscope prints the same."""
    lines = plan_placement(n_layer, -1, resolve_gpus(devices)).info_log_lines()
    assert f"load_tensors: offloading {n_layer - 1} repeating layers to GPU" in lines
    assert f"load_tensors: offloaded {n_layer + 1}/{n_layer + 1} layers to GPU" in lines
    return lines


def layer_map(watcher) -> str:
    """Each layer's device (and its K/V's when they differ), from the events a view's watcher received."""
    watcher.poll()
    devices = watcher.mirror.devices
    runs: list[list] = []  # [first layer, last layer, text]
    for row in devices.layer_map():
        text = row.device + ("" if row.kv_device == row.device else f" (K/V on {row.kv_device})")
        text += f", {len(row.overridden)} weights on {row.overridden[0][1]} (-ot)" if row.overridden else ""
        if runs and runs[-1][2] == text:
            runs[-1][1] = row.layer
        else:
            runs.append([row.layer, row.layer, text])
    parts = [f"layer{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''} on {text}" for a, b, text in runs]
    return "; ".join(parts) + f"; the output layer on {devices.placement.output_device}"


def gpu_layers_of(session) -> list[int]:
    """The layers whose weights sit on a GPU."""
    return [il for il, d in enumerate(session.ctx.placement.layer_devices) if d.is_gpu]


# ---- estimated before, allocated after -------------------------------------------------------------------------
def allocated(session) -> dict[str, tuple[int, int, int]]:
    """Per device: (weights, K/V, compute) bytes the live context allocated (llama_memory_breakdown)."""
    return {dev.name: (mb.model, mb.context, mb.compute) for dev, mb in session.ctx.memory_breakdown().items()}


def check_estimate(est: Estimate, session) -> None:
    """The estimate from the file's headers equals, to the byte, what the context allocated on every device."""
    got = allocated(session)
    for row in est.devices:
        assert got.get(row.device, (0, 0, 0)) == (row.model_bytes, row.kv_bytes, row.compute_bytes), row.device


def memory_table(est: Estimate) -> str:
    """The estimate per device in MiB (weights, K/V, compute, total, and a virtual GPU's capacity)."""
    lines = [f"{'device':<16} {'weights':>8} {'K/V':>7} {'compute':>8} {'total':>8} {'capacity':>9}   (MiB)"]
    for d in est.devices:
        capacity = f"{d.capacity / MiB:9.2f}" if d.virtual and d.capacity else f"{'-':>9}"
        lines.append(f"{d.label:<16} {d.model_bytes / MiB:8.2f} {d.kv_bytes / MiB:7.2f} {d.compute_bytes / MiB:8.2f} "
                     f"{d.total_bytes / MiB:8.2f} {capacity}" + ("" if d.fits else "   DOES NOT FIT"))
    return "\n".join(lines)


def estimate_and_allocation(session) -> str:
    """The estimate for the session's current settings, checked against the allocation, and llama.cpp's own
    memory breakdown table of the live context."""
    est = session.estimate()
    check_estimate(est, session)
    return (memory_table(est) + "\n\nllama.cpp's table of what was allocated:\n"
            + "\n".join(session.ctx.memory_breakdown_lines()))


def overridden(session) -> list[str]:
    """The weights an -ot pattern sent to another device than their layer's."""
    return [name for name, _ in session.ctx.weight_devices.overridden]


def check_ffn_on_cpu(session) -> None:
    """-ot 'ffn_.*=CPU' with every layer offloaded: the MLP weights stay on the CPU, attention's K/V go to the GPU."""
    names = overridden(session)
    assert names and all(".ffn_" in name for name in names)
    assert all(d.is_gpu for d in session.ctx.placement.layer_devices)
    assert all(d.is_gpu for d in session.ctx.placement.kv_devices)


def tensor_split_rule(weights: list[float], n_off: int, names: list[str]) -> list[str]:
    """llama.cpp's split of n_off offloaded layers (output layer included) by -ts weights: cumulative split
    points in float32, and offloaded layer k goes to the first GPU whose point is above k / n_off
    (llama_model_base::load_tensors, src/llama-model.cpp)."""
    w = np.float32(weights)
    points = np.cumsum(w, dtype=np.float32) / np.float32(w.sum())
    return [names[int(np.searchsorted(points, np.float32(k) / np.float32(n_off), side="right"))] for k in range(n_off)]


def check_tensor_split(session, weights: list[float]) -> list[str]:
    """The session's layers (and output layer) are placed by llama.cpp's -ts rule; the token embeddings stay on
    the CPU. Returns the rule's devices, output layer last."""
    placement = session.ctx.placement
    names = sorted({d.name for d in placement.layer_devices} | {placement.output_device.name})
    rule = tensor_split_rule(weights, len(placement.layer_devices) + 1, names)
    placed = [d.name for d in placement.layer_devices] + [placement.output_device.name]
    assert placed == rule, (placed, rule)
    cfg = session.ctx.model.config
    assert allocated(session)["CPU"][0] == cfg.n_vocab * cfg.n_embd * 4  # the f32 token embeddings
    return rule


def check_no_kv_offload(before: dict, after: dict) -> None:
    """-nkvo: every layer's K/V moves to the CPU, and the attention that reads them runs there (so a CPU that
    computed nothing before needs a compute buffer now); no weight moves."""
    assert after["CPU"][1] == sum(kv for _, kv, _ in before.values())
    assert all(kv == 0 for name, (_, kv, _) in after.items() if name != "CPU")
    assert after["CPU"][2] >= before["CPU"][2] and after["CPU"][2] > 0
    assert {name: w for name, (w, _, _) in after.items()} == {name: w for name, (w, _, _) in before.items()}


def refused_rebuild(session, **settings) -> tuple[Estimate, str]:
    """Settings that do not fit: the estimate says so, the rebuild is refused with the same bytes and the
    session keeps its settings. (estimate, the refusal's message)."""
    est = session.estimate(**settings)
    assert not est.fits
    before = session.status().settings
    try:
        session.rebuild(**settings).result()
    except engine.ContextParamsError as e:
        error = str(e)
    else:
        raise AssertionError("the rebuild should have been refused")
    short = next(row for row in est.devices if not row.fits)
    assert f"need {short.total_bytes} bytes on {short.device}" in error
    assert session.status().settings == before
    return est, error


GENESIS = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: and God "
           "divided the light from the darkness. And God called the light Day, and the darkness he called Night. And "
           "the evening and the morning were the first day.")


def genesis_tokens(model, n: int = 60) -> list[int]:
    """The first n tokens of Genesis 1:3-5 (with the <bos> the tokenizer adds): the text section 5 decodes."""
    tokens = model.tokenizer.encode(GENESIS)[:n]
    assert len(tokens) == n, len(tokens)
    return tokens


# ---- quantized K/V ------------------------------------------------------------------------------------------
def kv_bytes(model, type_k: str, type_v: str, n_ctx: int = 1024) -> int:
    """K/V bytes of a context of both caches (base and swa), checked against ggml's block layout and the
    context's memory breakdown."""
    ctx = engine.Context(model, n_ctx=n_ctx, type_k=type_k, type_v=type_v)
    if BLOCK[type_v][0] > 1:  # a quantized V: flash_attn "auto" (the default) turned flash attention on
        assert ctx.params.flash_attn == "on", ctx.params.flash_attn
    made = [e for e in ctx.state_events() if isinstance(e, ev.ContextCreated)]
    nbytes = sum(e.k_bytes + e.v_bytes for e in made)
    rows = sum(e.kv_size * e.n_stream * e.n_layer for e in made) * model.config.n_embd_k_gqa
    rule = sum(rows // BLOCK[t][0] * BLOCK[t][1] for t in (type_k, type_v))
    assert nbytes == rule == allocated_context(ctx), (type_k, type_v, nbytes, rule)
    return nbytes


def allocated_context(ctx) -> int:
    return sum(mb.context for mb in ctx.memory_breakdown().values())


def kv_bytes_by_type(model, types=CACHE_TYPES, n_ctx: int = 1024) -> dict[str, int]:
    return {t: kv_bytes(model, t, t, n_ctx) for t in types}


def kv_table(kv: dict[str, int]) -> str:
    lines = [f"{'type':<7} {'values/block':>12} {'bytes/block':>11} {'K/V MiB':>8} {'x f16':>6}"]
    for t, n in kv.items():
        values, size = BLOCK[t]
        lines.append(f"{t:<7} {values:>12} {size:>11} {n / MiB:8.2f} {n / kv['f16']:6.2f}")
    return "\n".join(lines)


def check_rotation_applies(model) -> int:
    """llama.cpp rotates a quantized K/V by a Hadamard matrix when the head size is a multiple of 64: the demo
    model's qualifies, so llama.cpp would rotate its quantized caches (kvscope does not)."""
    head = model.config.head_dim
    assert head % 64 == 0, head
    return head


def log_probs(model, tokens: list[int], type_k: str, type_v: str):
    """Every position's next-token log-probabilities (all in one batch) with this cache type."""
    import torch

    ctx = engine.Context(model, n_ctx=128, type_k=type_k, type_v=type_v)
    assert ctx.decode(engine.Batch.for_sequence(tokens, 0, 0, all_logits=True)) == 0, ctx.last_error
    return torch.log_softmax(ctx.all_logits().double(), dim=-1)


def quality_by_type(model, tokens: list[int], types=CACHE_TYPES) -> dict[str, tuple[float, float]]:
    """Per cache type: (mean KL divergence from an f32 cache's distributions in nats, share of positions whose
    most likely next token is the f32 cache's). Checked: f32 is the reference, and every 8- and 16-bit type
    diverges less than every 4-bit one."""
    reference = log_probs(model, tokens, "f32", "f32")
    quality = {}
    for t in types:
        lp = log_probs(model, tokens, t, t)
        kl = (reference.exp() * (reference - lp)).sum(-1)
        quality[t] = (float(kl.mean()), float((lp.argmax(-1) == reference.argmax(-1)).double().mean()))
    assert quality["f32"] == (0.0, 1.0)
    assert max(quality[t][0] for t in ("f16", "bf16", "q8_0")) < min(quality[t][0] for t in ("q4_0", "q4_1", "iq4_nl"))
    return quality


def quality_table(kv: dict[str, int], quality: dict[str, tuple[float, float]]) -> str:
    lines = [f"{'type':<7} {'K/V MiB':>8} {'mean KL (nats)':>15} {'top-1 same':>11}"]
    for t, (kl, top1) in quality.items():
        lines.append(f"{t:<7} {kv[t] / MiB:8.2f} {kl:15.2e} {100 * top1:10.1f}%")
    return "\n".join(lines)


def quality_figure(kv: dict[str, int], quality: dict[str, tuple[float, float]]):
    """Memory against divergence, one point per quantized or 16-bit type (f32, the reference, has KL 0)."""
    import plotly.graph_objects as go

    types = [t for t in quality if t != "f32"]
    # types of the same bytes sit one above the other: the second one's name goes to the right
    sides = ["middle right" if any(kv[u] == kv[t] for u in types[:k]) else "top center" for k, t in enumerate(types)]
    figure = go.Figure(go.Scatter(x=[kv[t] / MiB for t in types], y=[quality[t][0] for t in types], text=types,
                                  mode="markers+text", textposition=sides, marker=dict(size=10)))
    figure.update_layout(width=700, height=380, margin=dict(l=60, r=20, t=40, b=50),
                         title="K/V memory against divergence from an f32 cache",
                         xaxis_title="K/V MiB (n_ctx 1024, both caches)", yaxis_title="mean KL (nats)",
                         yaxis=dict(type="log", exponentformat="e"))
    return figure


def cheapest_within(kv: dict[str, int], quality: dict[str, tuple[float, float]], max_kl: float) -> str:
    """The cache type with the fewest bytes whose mean KL stays below max_kl."""
    return min((t for t in quality if quality[t][0] < max_kl), key=lambda t: (kv[t], quality[t][0]))


# ---- A/B ---------------------------------------------------------------------------------------------------
def ab_kv_bytes(ab) -> tuple[int, int]:
    """Each column's K/V bytes, as its memory bars' events told them."""
    return tuple(sum(row.bytes.get("kv", 0) for row in column.watcher.mirror.devices.rows.values())
                 for column in ab.columns)


def check_ab(ab, type_a: str, type_b: str) -> dict:
    """The comparison's summary, after checking it compared something and the K/V bytes follow the block layouts."""
    summary = ab.comparison.summary()
    assert summary["n"] > 0 and 0 <= summary["top1_agreement"] <= 1 and summary["mean_kl"] >= 0
    a_kv, b_kv = ab_kv_bytes(ab)
    (va, sa), (vb, sb) = BLOCK[type_a], BLOCK[type_b]
    assert a_kv * sb * va == b_kv * sa * vb, (a_kv, b_kv)
    return summary


def ab_caption(ab, type_a: str, type_b: str) -> str:
    """What the A/B comparison found, in words (after check_ab)."""
    s = check_ab(ab, type_a, type_b)
    a_kv, b_kv = ab_kv_bytes(ab)
    differ = f"differ from position {s['first_difference']} on" if s["first_difference"] is not None else "never differ"
    return (f"{s['n']} positions compared over the same text: top-1 agreement {100 * s['top1_agreement']:.1f}%, mean "
            f"KL {s['mean_kl']:.4f} nats; the texts {differ}. K/V: {a_kv / MiB:.3f} MiB ({type_a}) against "
            f"{b_kv / MiB:.3f} MiB ({type_b}).")


# ---- the exercises' answers, computed ----------------------------------------------------------------------
def estimate_for(model, **settings) -> Estimate:
    """kvscope estimate for the loaded model with these settings (from the file's headers; nothing is made)."""
    from engine.sizing.estimate import estimate

    return estimate(model.path, keep_quantized=model.kept_quantized, **settings)


def largest_fitting_ngl(model, devices: list[str], n_ctx: int = 1024) -> int:
    """The largest -ngl whose estimate fits these devices at n_ctx (0 when none does)."""
    n_layer = model.config.n_layer
    return max((k for k in range(n_layer + 2) if estimate_for(model, n_ctx=n_ctx, devices=devices,
                                                              n_gpu_layers=k).fits), default=0)


def fit_words(model, devices: list[str], n_ctx: int = 1024) -> str:
    """Why the largest fitting -ngl is the largest: what it and one more layer need on the GPU, in words
    (checked: `kvscope estimate --fit` proposes the same -ngl)."""
    from engine.sizing.estimate import fit

    k = largest_fitting_ngl(model, devices, n_ctx)
    assert fit(model.path, keep_quantized=model.kept_quantized, devices=devices, n_ctx=n_ctx).placement.n_gpu_layers == k
    gpu = resolve_gpus(devices)[0]
    need = [next(d.total_bytes for d in estimate_for(model, n_ctx=n_ctx, devices=devices, n_gpu_layers=n).devices
                 if d.device == gpu.name) for n in (k, k + 1)]
    return (f"-ngl {k} needs {need[0] / MiB:.2f} MiB on {gpu.name}, -ngl {k + 1} {need[1] / MiB:.2f} MiB: more than "
            f"its {gpu.total_bytes() / MiB:.0f} (a GPU that computes any layer holds a compute buffer)")


def output_device(n_layer: int, ngl: int, devices: list[str]) -> str:
    """The device of the output layer with this -ngl."""
    return plan_placement(n_layer, ngl, resolve_gpus(devices)).output_device.name


def cache_sizes(model, **settings) -> str:
    """The caches a context with these settings makes, in words: "base 1 x 1024 cells, swa 1 x 768 cells"."""
    ctx = engine.Context(model, **settings)
    return ", ".join(f"{c.name} {c.layout.n_stream} x {c.layout.kv_size} cells" for c in ctx.memory.caches())


PARTS = {"weights": lambda d: d.model_bytes, "K/V": lambda d: d.kv_bytes, "compute": lambda d: d.compute_bytes}


def parts_that_grow(model, settings: dict, **changes) -> set[str]:
    """Which parts of the memory ("weights", "K/V", "compute"), summed over the devices, grow from `settings`
    to `settings` with `changes`."""
    now, then = estimate_for(model, **settings), estimate_for(model, **{**settings, **changes})
    return {name for name, part in PARTS.items()
            if sum(map(part, then.devices)) > sum(map(part, now.devices))}
