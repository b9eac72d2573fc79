"""The names articles about llama.cpp use: --kvsize, --swa-window, LLAMA_OFFLOAD_LAYERS, in the
Python API and in every command."""
from __future__ import annotations

import json
import re

import pytest
import torch

import engine
from engine import events as ev
from engine.batch import Batch
from engine.cli import main
from engine.llama_flags import build_parser
from engine.errors import ContextParamsError
from engine.placement.devices import resolve_gpus
from engine.sizing.estimate import estimate
from engine.sizing.settings_aliases import check_context_settings, check_swa_window
from tests.model_factory import in_memory_model

COMMANDS = ("generate", "parallel", "estimate")


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


# ---- kvsize ----------------------------------------------------------------------------------------------
def test_kvsize_is_n_ctx(demo):
    assert engine.Context(demo, kvsize=256).n_ctx == 256
    assert engine.Context(demo, kvsize=0).n_ctx == demo.config.n_ctx_train  # 0: n_ctx_train, as -c 0
    assert engine.Context(demo).n_ctx == 512  # llama.cpp's library default
    assert engine.Context(demo, n_ctx=256, kvsize=256).n_ctx == 256
    with pytest.raises(ContextParamsError, match="kvsize is another name for n_ctx"):
        engine.Context(demo, n_ctx=512, kvsize=256)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_aliases(command):
    args = build_parser().parse_args([command, "--kvsize", "768", "--swa-window", "32"])
    assert args.ctx_size == 768 and args.swa_window == 32


def test_cli_kvsize_sizes_the_cache(capsys):
    assert main(["generate", "--kvsize", "256", "-p", "And", "-n", "1", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "llama_context: n_ctx         = 256" in err
    assert main(["estimate", "--kvsize", "768", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_ctx"] == 768
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--kvsize is the name articles use; llama.cpp's is -c/--ctx-size" in " ".join(capsys.readouterr().out.split())


# ---- LLAMA_OFFLOAD_LAYERS --------------------------------------------------------------------------------
def test_offload_layers_env_is_the_default_of_n_gpu_layers(monkeypatch):
    model = in_memory_model(n_layer=4)
    gpu = resolve_gpus(["VGPU0=1GiB"])
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "2")
    ctx = engine.Context(model, n_ctx=256, devices=gpu)
    assert [d.name for d in ctx.placement.layer_devices] == ["CPU", "CPU", "CPU", "VGPU0"]
    del ctx
    assert engine.Context(model, n_ctx=256, devices=gpu, n_gpu_layers=0).placement.output_device.name == "CPU"
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "all")
    assert estimate("demo", n_ctx=256, devices=resolve_gpus(["VGPU0=1GiB"])).placement.n_gpu_layers == 7
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "lots")
    with pytest.raises(ContextParamsError, match="LLAMA_OFFLOAD_LAYERS = 'lots': expected a number of layers or 'all'"):
        engine.Context(model, n_ctx=256, devices=gpu)


def test_cli_reads_offload_layers_env_and_a_flag_wins(monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "3")
    assert main(["estimate", "--virtual-gpu", "VGPU0=1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_gpu_layers"] == 3
    assert main(["estimate", "--virtual-gpu", "VGPU0=1GiB", "-ngl", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_gpu_layers"] == 1


# ---- swa_window ------------------------------------------------------------------------------------------
def run_tokens(ctx, tokens):
    assert ctx.decode(Batch.for_sequence(tokens, seq_id=0, start_pos=0, all_logits=True)) == 0
    return ctx.all_logits().clone()


def test_swa_window_changes_the_window_and_the_swa_cache_size(demo):
    bus = ev.EventBus()
    sub = bus.subscribe()
    ctx = engine.Context(demo, n_ctx=1024, n_ubatch=64, swa_window=16, bus=bus)
    caches = {c.name: c for c in ctx.memory.caches()}
    assert caches["swa"].layout.n_swa == 16 and caches["base"].layout.n_swa == 0
    assert caches["swa"].size == 256  # 16 + 64 cells rounded up to the padding; the model's 64 + 64 also 256
    created = {e.cache: e for e in sub.drain() if isinstance(e, ev.ContextCreated)}
    assert (created["swa"].n_swa, created["swa"].n_swa_train) == (16, 64)
    assert any("n_swa = 16 replaces the model's sliding window of 64" in line for line in ctx.init_log_lines)
    small = engine.Context(demo, n_ctx=1024, n_ubatch=64, swa_window=16, pad=32)
    assert [c.size for c in small.memory.caches() if c.name == "swa"] == [96]  # 16 + 64, padded to 32
    trained = engine.Context(demo, n_ctx=1024, n_ubatch=64, pad=32)
    assert [c.size for c in trained.memory.caches() if c.name == "swa"] == [128]


def test_swa_window_decides_what_each_token_sees(demo):
    tokens = [(7 * i + 3) % demo.n_vocab for i in range(40)]
    trained = run_tokens(engine.Context(demo, n_ctx=256), tokens)
    narrow = run_tokens(engine.Context(demo, n_ctx=256, swa_window=16), tokens)
    # positions 0..15 see at most 16 keys: the windows agree; from 16 on the narrow window hides keys
    assert torch.equal(narrow[:16], trained[:16])
    assert not torch.allclose(narrow[16:], trained[16:], atol=1e-3)


def test_swa_window_needs_a_sliding_window_model_and_a_positive_size(demo):
    with pytest.raises(ContextParamsError, match="has no sliding-window layers"):
        engine.Context(in_memory_model(), n_ctx=256, swa_window=8)
    with pytest.raises(ContextParamsError, match="swa_window must be >= 1"):
        engine.Context(demo, n_ctx=256, swa_window=0)


def test_estimate_follows_swa_window(demo):
    settings = dict(n_ctx=1024, n_ubatch=64, pad=32, swa_window=16)
    est = estimate("demo", **settings)
    ctx = engine.Context(demo, **settings)
    assert est.devices[0].kv_bytes == sum(c.k_bytes() + c.v_bytes() for c in ctx.memory.caches())
    assert est.devices[0].kv_bytes < estimate("demo", n_ctx=1024, n_ubatch=64, pad=32).devices[0].kv_bytes


# ---- checks that need no model (the commands run them before loading) ---------------------------------------
GOOD_SETTINGS = dict(n_ctx=0, n_batch=2048, n_ubatch=512, n_seq_max=1, pad=256, type_k="f16", type_v="f16",
                     flash_attn="auto")


@pytest.mark.parametrize("bad", [
    dict(pad=0), dict(n_ctx=-5), dict(n_ubatch=-1), dict(n_seq_max=257), dict(flash_attn="maybe"),
    dict(type_k="q9_9"), dict(type_v="q8_0", flash_attn="off"),
], ids=str)
def test_settings_checks_say_what_the_context_says(bad):
    """The context's own message starts the check's one (the check may add the fix)."""
    with pytest.raises(ContextParamsError) as checked:
        check_context_settings(**{**GOOD_SETTINGS, **bad})
    with pytest.raises(ContextParamsError) as context:
        engine.Context(in_memory_model(), **{**GOOD_SETTINGS, **bad})
    assert str(checked.value).startswith(str(context.value).split(";")[0])


@pytest.mark.parametrize("bad,message", [
    (dict(n_batch=0), "n_batch must be >= 1, got 0: no batch could be decoded"),
    (dict(n_ubatch=0), "n_ubatch must be >= 1, got 0: no ubatch could be computed"),
    (dict(n_seq_max=300), "n_seq_max = 300 > 256: llama.cpp's contexts hold at most 256 sequences"),
])
def test_settings_checks_need_no_model(bad, message):
    with pytest.raises(ContextParamsError, match=re.escape(message)):
        check_context_settings(**{**GOOD_SETTINGS, **bad})


@pytest.mark.parametrize("settings,n_seq_max", [
    (dict(type_k="q8_0"), 1),  # no head size known yet: the block check waits for the model
    (dict(n_seq_max=0), 1),  # the context takes at least one sequence, as llama.cpp
])
def test_settings_checks_pass_what_the_context_takes(settings, n_seq_max):
    check_context_settings(**{**GOOD_SETTINGS, **settings})
    model = in_memory_model(head_dim=32, n_embd=64, n_head=2, n_head_kv=1)  # heads of one q8_0 block
    ctx = engine.Context(model, **{**GOOD_SETTINGS, **settings, "n_ctx": 256})
    assert ctx.n_seq_max == n_seq_max and ctx.memory.layout.type_k.name == settings.get("type_k", "f16")


def test_block_size_is_checked_when_head_sizes_are_given():
    check_context_settings(**{**GOOD_SETTINGS, "type_k": "q8_0"}, head_dims=(64, 64))
    with pytest.raises(ContextParamsError, match="K cache type q8_0 with block size 32 does not divide "
                                                 "n_embd_head_k=40"):
        check_context_settings(**{**GOOD_SETTINGS, "type_k": "q8_0"}, head_dims=(40,))


def test_swa_window_is_checked_without_a_model():
    check_swa_window(None)
    check_swa_window(1)
    with pytest.raises(ContextParamsError, match="swa_window must be >= 1, got 0"):
        check_swa_window(0)
