"""Notebook 6's lesson module (kvscope/lessons/offload.py): llama.cpp's placement rules as the notebook prints
them, the estimate checked against the allocation, and quantized K/V bytes and quality."""
from __future__ import annotations

import pytest

pytest.importorskip("plotly")

import engine  # noqa: E402
from engine.runners.session import Session  # noqa: E402
from engine.sizing.settings_aliases import OFFLOAD_LAYERS_ENV  # noqa: E402
from kvscope.lessons import offload as lesson  # noqa: E402

VGPU = ["VGPU0=64MiB"]


@pytest.fixture(scope="module")
def model():
    return engine.load_model("demo")


def test_ngl_counts_the_output_layer_as_the_last_of_n_plus_one(model):
    n = model.config.n_layer
    rows = lesson.ngl_table(n, VGPU).splitlines()[1:]
    assert len(rows) == n + 2
    assert rows[0].split()[:5] == ["0", "C" * n, "+", "C", "load_tensors:"]
    assert rows[1].split()[1:4] == ["C" * n, "+", "G"]  # -ngl 1: the output layer alone
    assert rows[n].split()[1:4] == ["C" + "G" * (n - 1), "+", "G"]  # -ngl n: block 0 stays on the CPU
    assert rows[n + 1].endswith(f"offloaded {n + 1}/{n + 1} layers to GPU")
    assert lesson.layer_letters(n, 4, engine.placement.devices.resolve_gpus(VGPU)) == "CCCGGG + G"
    assert lesson.output_device(n, 1, VGPU) == "VGPU0" and lesson.output_device(n, 0, VGPU) == "CPU"
    assert "load_tensors: offloading 5 repeating layers to GPU" in lesson.full_offload_log(n, VGPU)


def test_kvscopes_default_is_no_offload_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(OFFLOAD_LAYERS_ENV, raising=False)
    assert lesson.check_default_gpu_layers() == 0
    monkeypatch.setenv(OFFLOAD_LAYERS_ENV, "all")
    assert lesson.check_default_gpu_layers() == -1  # the reader's own default is left alone


def test_tensor_split_follows_llama_cpps_float32_rule():
    names = ["VGPU0", "VGPU1"]
    assert lesson.tensor_split_rule([3, 1], 7, names) == ["VGPU0"] * 6 + ["VGPU1"]
    assert lesson.tensor_split_rule([1, 1], 7, names) == ["VGPU0"] * 4 + ["VGPU1"] * 3  # k / 7 < 0.5 for k <= 3
    assert lesson.tensor_split_rule([1, 0], 7, names) == ["VGPU0"] * 7


def test_the_estimate_equals_the_allocation_and_a_setting_too_large_is_refused(model):
    session = Session(model, settings=dict(n_ctx=256, n_seq_max=1, devices=VGPU, n_gpu_layers=4), threaded=False,
                      threads=1)
    try:
        text = lesson.estimate_and_allocation(session)
        assert text.splitlines()[0].startswith("device") and "llama_memory_breakdown_print" in text
        assert "VGPU0 (virtual)" in text.splitlines()[2] and "DOES NOT FIT" not in text
        assert lesson.gpu_layers_of(session) == [3, 4, 5]
        watcher = engine.watch.Watcher.of(session)
        assert lesson.layer_map(watcher) == "layers 0-2 on CPU; layers 3-5 on VGPU0; the output layer on VGPU0"
        before = lesson.allocated(session)
        est, error = lesson.refused_rebuild(session, devices=["VGPU0=8MiB"], n_gpu_layers=-1)
        assert "need" in error and "VGPU0" in error and "DOES NOT FIT" in lesson.memory_table(est)
        assert lesson.allocated(session) == before  # nothing changed
        session.rebuild(offload_kqv=False).result()
        lesson.check_no_kv_offload(before, lesson.allocated(session))
        assert lesson.layer_map(watcher).startswith("layers 0-2 on CPU; layers 3-5 on VGPU0 (K/V on CPU)")
    finally:
        session.close()


def test_the_no_kv_offload_check_refuses_moved_weights_or_kv_left_on_a_gpu():
    before = {"CPU": (10, 1, 0), "VGPU0": (20, 2, 5)}
    lesson.check_no_kv_offload(before, {"CPU": (10, 3, 2), "VGPU0": (20, 0, 5)})
    with pytest.raises(AssertionError):  # the attention runs on the CPU now: it needs a compute buffer
        lesson.check_no_kv_offload(before, {"CPU": (10, 3, 0), "VGPU0": (20, 0, 5)})
    with pytest.raises(AssertionError):
        lesson.check_no_kv_offload(before, {"CPU": (10, 3, 2), "VGPU0": (20, 1, 5)})
    with pytest.raises(AssertionError):
        lesson.check_no_kv_offload(before, {"CPU": (11, 3, 2), "VGPU0": (19, 0, 5)})


def test_quantized_kv_bytes_follow_ggmls_blocks(model):
    kv = lesson.kv_bytes_by_type(model, ["f32", "f16", "q8_0", "q4_0"], n_ctx=256)
    assert kv["f32"] == 2 * kv["f16"]
    assert kv["q8_0"] * 64 == kv["f16"] * 34 and kv["q4_0"] * 64 == kv["f16"] * 18
    assert lesson.kv_bytes(model, "q8_0", "f16", n_ctx=256) * 2 == kv["q8_0"] + kv["f16"]
    assert lesson.kv_bytes(model, "f16", "q4_0", n_ctx=256) * 2 == kv["f16"] + kv["q4_0"]  # flash attention: on
    table = lesson.kv_table(kv).splitlines()
    assert table[3].split() == ["q8_0", "32", "34", f"{kv['q8_0'] / lesson.MiB:.2f}", "0.53"]
    assert lesson.check_rotation_applies(model) == 64


def test_fewer_bits_diverge_more(model):
    tokens = model.tokenizer.encode("And God said, Let there be light: and there was light. And God saw the light, "
                                    "that it was good: and God divided the light from the darkness.")
    quality = lesson.quality_by_type(model, tokens)  # asserts the ordering the notebook states
    kv = {t: lesson.BLOCK[t][1] * 1024 // lesson.BLOCK[t][0] for t in quality}  # bytes per 1024 values
    assert lesson.cheapest_within(kv, quality, 1.0) in ("q4_0", "iq4_nl")
    assert lesson.cheapest_within(kv, quality, quality["q8_0"][0] * 1.0001) in ("q8_0", "q5_0", "q5_1", "q4_1",
                                                                                 "q4_0", "iq4_nl")
    assert lesson.quality_table(kv, quality).splitlines()[1].split()[0] == "f32"


def test_the_quality_figure_keeps_the_names_of_types_of_equal_bytes_apart():
    kv = {"f32": 4, "f16": 2, "q4_0": 1, "iq4_nl": 1}
    quality = {"f32": (0.0, 1.0), "f16": (1e-7, 1.0), "q4_0": (1e-2, 0.9), "iq4_nl": (2e-2, 0.9)}
    scatter = lesson.quality_figure(kv, quality).data[0]
    assert list(scatter.text) == ["f16", "q4_0", "iq4_nl"]  # f32, the reference, has no divergence to plot
    assert list(scatter.textposition) == ["top center", "top center", "middle right"]
    assert lesson.cheapest_within(kv, quality, 1e-3) == "f16"


def test_the_exercises_answers(model):
    assert lesson.largest_fitting_ngl(model, ["VGPU0=24MiB"], n_ctx=1024) == 1
    assert lesson.largest_fitting_ngl(model, ["VGPU0=1MiB"], n_ctx=1024) == 0
    assert lesson.largest_fitting_ngl(model, ["VGPU0=256MiB"], n_ctx=1024) == model.config.n_layer + 1
    assert lesson.fit_words(model, ["VGPU0=24MiB"]).startswith("-ngl 1 needs ")
    grow = dict(n_seq_max=4, kv_unified=False)
    assert lesson.parts_that_grow(model, dict(n_ctx=1024), **grow) == {"K/V"}
    assert lesson.parts_that_grow(model, dict(n_ctx=1024), n_ctx=2048) == {"K/V"}
    assert lesson.cache_sizes(model, n_ctx=1024, **grow) == "base 4 x 256 cells, swa 4 x 256 cells"
