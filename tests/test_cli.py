"""The `kvscope` command prints llama.cpp's init and perf lines and streams the text."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import engine
from engine.cli import main
from engine.placement.devices import CPU


def run(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_prints_init_line_text_and_perf(tiny_llama_gguf, capsys):
    rc, out, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The baker", "-n", "8", "-c", "300",
                        "--seed", "3", "--temp", "0"], capsys)
    assert rc == 0
    assert out.startswith("The baker")
    # 300 rounds up to 512 cells; K: 2 layers x (2 KV heads x 16 dims) x 512 cells x 2 bytes = 64 KiB
    assert "llama_kv_cache: size =    0.12 MiB (   512 cells,   2 layers,  1/1 seqs), K (f16):    0.06 MiB, " \
           "V (f16):    0.06 MiB" in err
    assert "llama_kv_cache:        CPU KV buffer size =     0.12 MiB" in err
    assert re.search(r"prompt eval time = +[\d.]+ ms / +\d+ tokens \( *[\d.]+ ms per token, +[\d.]+ tokens per second\)", err)
    assert re.search(r"       eval time = +[\d.]+ ms / +7 runs", err)


def test_generate_parallel_split_streams(tiny_llama_gguf, capsys):
    rc, out, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "Once", "-n", "4", "-np", "3", "-c", "768",
                        "--seed", "1"], capsys)
    assert rc == 0
    assert out.count("[seq ") == 3
    assert "(   256 cells,   2 layers,  3/3 seqs)" in err


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    rc, _, err = run(["generate", "-m", str(tmp_path / "missing.gguf")], capsys)
    assert rc == 1
    assert "missing.gguf" in err and "error:" in err


def test_console_script_is_installed():
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("-ctk", "-ub", "-np", "-kvu", "--pad", "--temp", "--top-k", "--min-p", "--repeat-penalty",
                 "--context-shift", "--keep", "-ngl", "--n-gpu-layers", "-ts", "-nkvo",
                 "--virtual-gpu"):
        assert flag in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "parallel", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("-np", "-ns", "--sequences", "-kvu", "-c", "-b", "-ub", "--pad", "--seed", "--temp"):
        assert flag in proc.stdout


def test_default_context_is_the_models_training_context(capsys):
    """-c defaults to 0, llama.cpp's "use n_ctx_train": 1024 cells for the demo model."""
    rc, _, err = run(["generate", "-p", "And", "-n", "2", "--temp", "0"], capsys)
    assert rc == 0
    assert "llama_kv_cache_iswa: creating non-SWA KV cache, size = 1024 cells" in err


def test_virtual_gpu_offload_prints_placement_and_kv_buffer(tiny_llama_gguf, capsys):
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "2", "-c", "256", "--pad", "32",
                      "--temp", "0", "--virtual-gpu", "VGPU0=64MiB", "-ngl", "99"], capsys)
    assert rc == 0
    assert "load_tensors: offloaded 3/3 layers to GPU" in err  # 2 layers + the output layer
    assert re.search(r"llama_kv_cache: VGPU0 \(virtual\) KV buffer size = +[\d.]+ MiB", err)
    assert "CPU KV buffer size" not in err
    # the input embedding is on the CPU: each token's activation (64 f32 values) crosses to VGPU0 once,
    # and each of the two decodes sends one row of logits back to the host
    m = re.search(r"kvscope_perf_print: device transfers = +[\d.]+ MiB / +(\d+) tokens \( *(\d+) bytes per token, "
                  r"+[\d.]+ ms copying\)", err)
    n_tokens, n_vocab = int(m.group(1)), engine.load_model(tiny_llama_gguf).config.n_vocab
    assert int(m.group(2)) == round((n_tokens * 256 + 2 * n_vocab * 4) / n_tokens)


def test_ngl_all_tensor_split_and_nkvo_flags(tiny_llama_gguf, capsys):
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-c", "256", "--temp", "0",
                      "--virtual-gpu", "VGPU0=64MiB", "--virtual-gpu", "VGPU1=64MiB", "-ngl", "all", "-ts", "1,1",
                      "-nkvo", "-v"], capsys)
    assert rc == 0
    assert "load_tensors: layer   0 assigned to device VGPU0 (virtual)" in err
    assert "load_tensors: layer   2 assigned to device VGPU1 (virtual)" in err  # the output layer
    assert "llama_kv_cache:        CPU KV buffer size" in err and "VGPU0 (virtual) KV buffer" not in err


def test_too_small_virtual_gpu_is_a_clear_error(tiny_llama_gguf, capsys):
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-c", "256",
                      "--virtual-gpu", "VGPU0=1KiB", "-ngl", "all"], capsys)
    assert rc == 1
    assert re.search(r"error: weights \(\d+ bytes\), the KV cache \(\d+ bytes\) and compute buffers \(\d+ bytes\) need "
                     r"\d+ bytes on VGPU0 "
                     r"\(virtual\) but only 1024 bytes are free", err)


def test_parallel_accepts_the_device_flags(tiny_llama_gguf, capsys):
    rc, _, err = run(["parallel", "-m", str(tiny_llama_gguf), "-np", "2", "-ns", "2", "-n", "4", "-c", "512",
                      "--seed", "1", "--virtual-gpu", "VGPU0=64MiB", "-ngl", "1"], capsys)
    assert rc == 0
    assert "load_tensors: offloaded 1/3 layers to GPU" in err


def test_generate_refuses_np_0(capsys):
    rc, _, err = run(["generate", "-p", "And", "-n", "2", "-np", "0"], capsys)
    assert rc == 1 and "error: -np must be >= 1, got 0" in err


# ---- settings are checked before the model is loaded --------------------------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    """Loading a model (or, for estimate, reading its headers) fails the test: the error must come first."""
    import engine.sizing.estimate

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(engine, "load_model", refuse)
    monkeypatch.setattr(engine.sizing.estimate, "config_from_headers", refuse)


BAD_SETTINGS = [
    (["-c", "-5"], "sizes must not be negative (n_ctx=-5"),
    (["-b", "0"], "n_batch must be >= 1, got 0"),
    (["-ub", "0"], "n_ubatch must be >= 1, got 0"),
    (["-b", "-1"], "sizes must not be negative"),
    (["-np", "0"], "-np must be >= 1, got 0"),
    (["-np", "300"], "n_seq_max = 300 > 256"),
    (["--pad", "0"], "pad must be >= 1, got 0"),
    (["-ctk", "q9_9"], "unsupported KV cache type 'q9_9'"),
    (["-ctv", "q8_0", "-fa", "off"], "quantized V cache requires flash_attn to be enabled"),
    (["--swa-window", "0"], "swa_window must be >= 1, got 0"),
    (["-ts", "1,1"], "tensor_split has 2 values for 0 GPUs"),
    (["--virtual-gpu", "VGPU0=1GiB", "-ts", "-1"], "tensor_split weights must be >= 0"),
    (["--virtual-gpu", "VGPU0=2XB"], "bad size '2XB'"),
    (["--virtual-gpu", "VGPU0=1GiB", "-ot", "ffn_.*=GPU9"], "unknown buffer type 'GPU9'"),
]


@pytest.mark.parametrize("command", ["generate", "parallel", "estimate"])
@pytest.mark.parametrize("flags,message", BAD_SETTINGS, ids=[" ".join(f) for f, _ in BAD_SETTINGS])
def test_context_settings_are_refused_before_loading(command, flags, message, no_load, monkeypatch, capsys):
    monkeypatch.setattr("engine.placement.devices.discover_devices", lambda: [CPU])  # "0 GPUs" on any machine
    if command == "parallel" and flags == ["-np", "300"]:  # one more sequence for the shared system prompt
        message = "-np must be <= 255 for parallel, got 300: sequence 0 holds the shared system prompt"
    rc, _, err = run([command, *flags], capsys)
    assert rc == 1
    assert f"error: {message}" in err


@pytest.mark.parametrize("command,flags,message", [
    ("generate", ["-n", "-2"], "error: n_predict must be -1 (no limit), 0 (the prompt only) or more, got -2"),
    ("generate", ["--top-p", "0"], "error: top_p must be in (0, 1]"),
    ("parallel", ["--temp", "nan"], "error: temperature must be a finite number"),
    ("parallel", ["-n", "0"], "error: n_predict must be >= 1, got 0"),
    ("parallel", ["-ns", "-1"], "error: --sequences must be >= 0, got -1"),
    ("parallel", ["--arrival-gap", "-1"], "error: arrival_gap must be >= 0, got -1"),
    ("parallel", ["--system-prompt", ""], "error: share_system_prompt needs a non-empty system prompt"),
])
def test_generation_settings_are_refused_before_loading(command, flags, message, no_load, capsys):
    rc, _, err = run([command, *flags], capsys)
    assert rc in (1, 2)
    assert message in err


@pytest.mark.parametrize("variable,value,message", [
    ("LLAMA_OFFLOAD_LAYERS", "lots", "error: LLAMA_OFFLOAD_LAYERS = 'lots': expected a number of layers or 'all'"),
    ("LLAMA_KV_CACHE_DEBUG", "abc", "error: LLAMA_KV_CACHE_DEBUG='abc' is not an integer"),
])
def test_environment_is_checked_before_loading(variable, value, message, no_load, monkeypatch, capsys):
    monkeypatch.setenv(variable, value)
    rc, _, err = run(["generate"], capsys)
    assert rc == 1 and message in err


def test_good_settings_still_load_and_run(tiny_llama_gguf, capsys):
    """The checks refuse nothing a context accepts: the smallest sizes and the largest -np run."""
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-b", "1", "-ub", "1",
                      "--pad", "1", "-c", "256", "-np", "256", "--temp", "0"], capsys)
    assert rc == 0, err
    # taken as given, not clamped: 256 streams of one cell each, batches of one token
    for line in ("llama_context: n_seq_max     = 256", "llama_context: n_batch       = 1",
                 "llama_context: n_ubatch      = 1", "(     1 cells,   2 layers, 256/256 seqs)"):
        assert line in err


def short_run(command: str, model) -> list[str]:
    """A command line that runs `command` on `model` in well under a second."""
    work = {"generate": ["-p", "The", "-n", "2", "--seed", "1"], "parallel": ["-ns", "1", "-n", "2", "--seed", "1"],
            "estimate": []}[command]
    return [command, "-m", str(model), "-c", "512", *work]


# ---- LLAMA_KV_CACHE_DEBUG without -v ----------------------------------------------------------------------
KV_DEBUG_HINT = "warning: LLAMA_KV_CACHE_DEBUG=2: the find_slot dump is printed at debug level; add -v to see it"


@pytest.mark.parametrize("command", ["generate", "parallel"])
def test_kv_cache_debug_without_verbose_says_where_the_dump_is(command, tiny_llama_gguf, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "2")
    rc, _, err = run(short_run(command, tiny_llama_gguf), capsys)
    assert rc == 0
    assert err.count(KV_DEBUG_HINT) == 1
    assert err.index(KV_DEBUG_HINT) < err.index("load_tensors:")  # at start, before the load
    assert "find_slot:" not in err


def test_kv_cache_debug_with_verbose_prints_the_dump_and_no_hint(tiny_llama_gguf, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "2")
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-c", "256", "-v"], capsys)
    assert rc == 0
    assert "find_slot: stream[0]" in err and "LLAMA_KV_CACHE_DEBUG=2:" not in err


# ---- -ngl without a GPU ------------------------------------------------------------------------------------
NO_GPU_WARNING = [
    "warning: no usable GPU found, --gpu-layers option will be ignored",
    "warning: one possible reason is that torch was installed without GPU support (a CPU-only build)",
    "warning: to offload layers without a GPU, add a virtual one: --virtual-gpu VGPU0=2GiB",
]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr("engine.placement.devices.discover_devices", lambda: [CPU])


@pytest.mark.parametrize("command", ["generate", "parallel", "estimate"])
def test_gpu_layers_without_a_gpu_warn_as_llama_cpp(command, tiny_llama_gguf, no_gpu, capsys):
    rc, _, err = run([*short_run(command, tiny_llama_gguf), "-ngl", "4"], capsys)
    assert rc == 0
    lines = err.splitlines()
    assert lines[:3] == NO_GPU_WARNING  # at start, and once
    assert sum(line.startswith("warning: no usable GPU") for line in lines) == 1


def test_offload_layers_env_without_a_gpu_warns_too(tiny_llama_gguf, no_gpu, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_OFFLOAD_LAYERS", "all")
    rc, _, err = run(["generate", "-m", str(tiny_llama_gguf), "-p", "The", "-n", "1", "-c", "256"], capsys)
    assert rc == 0
    assert err.splitlines()[:3] == ["warning: no usable GPU found, LLAMA_OFFLOAD_LAYERS=all will be ignored",
                                    *NO_GPU_WARNING[1:]]


@pytest.mark.parametrize("flags", [[], ["-ngl", "0"], ["-ngl", "4", "--virtual-gpu", "VGPU0=64MiB"],
                                   ["--fit", "-ngl", "4"]])
def test_no_gpu_warning_when_nothing_is_ignored(flags, tiny_llama_gguf, no_gpu, capsys):
    rc, _, err = run(["estimate", "-m", str(tiny_llama_gguf), "-c", "256", *flags], capsys)
    assert rc == 0
    assert "no usable GPU" not in err


# ---- a reader that goes away ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["estimate", "--json"],
    ["estimate"],
    ["generate", "-p", "The", "-n", "4", "--temp", "0"],
    ["parallel", "-np", "2", "-ns", "2", "-n", "4", "--seed", "1", "--steps"],
], ids=" ".join)
def test_closed_stdout_ends_quietly(argv, tiny_llama_gguf):
    """`kvscope ... | head -c 10`: the reader closes the pipe; the command stops without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", argv[0], "-m", str(tiny_llama_gguf), "-c", "256",
                             *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    proc.stdout.close()  # before the first byte, so that every write fails, whatever the pipe's buffer size
    _, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, 141), err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err and b"Exception ignored" not in err


def test_head_reads_the_start_of_the_output(tiny_llama_gguf):
    """The same through a real shell pipe: `head` gets its bytes, the command leaves no traceback."""
    proc = subprocess.run(f"{sys.executable} -m engine.cli estimate --json -m {tiny_llama_gguf} | head -c 10",
                          shell=True, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.stdout == b'{\n  "model'
    assert b"Traceback" not in proc.stderr


# ---- usage errors ----------------------------------------------------------------------------------------
def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "parallel", "estimate"])
def test_threads_flag_is_refused_with_the_commands_usage(command, capsys):
    err = usage_error([command, "-t", "4"], capsys)
    assert err.startswith(f"usage: kvscope {command} ")
    assert f"kvscope {command}: error: unrecognized arguments: -t 4" in err
    assert "-t (threads) is not supported: kvscope uses torch's threads" in err


def test_unknown_flag_is_named_with_the_commands_usage(capsys):
    err = usage_error(["generate", "-p", "x", "--bogus", "3"], capsys)
    assert err.startswith("usage: kvscope generate ")
    assert "kvscope generate has no flag --bogus; `kvscope generate --help` lists its flags" in err


def test_stray_argument_is_named(capsys):
    err = usage_error(["estimate", "model.gguf"], capsys)
    assert err.startswith("usage: kvscope estimate ") and "unrecognized arguments: model.gguf" in err


def flag_help(command: str) -> dict[str, str]:
    """Each flag's help text as --help prints it (before wrapping)."""
    from engine.llama_flags import DefaultsHelpFormatter, build_parser

    sub = build_parser().commands[command]
    formatter = DefaultsHelpFormatter(prog=sub.prog)
    return {action.option_strings[0]: formatter._expand_help(action) for action in sub._actions
            if action.option_strings and action.dest != "help"}


@pytest.mark.parametrize("command", ["generate", "parallel", "estimate"])
def test_every_flag_shows_its_default(command):
    texts = flag_help(command)
    assert {"-c", "-ngl", "--virtual-gpu"} <= set(texts)  # the parser's flags were found
    for flag, text in texts.items():
        assert "default" in text, f"kvscope {command} {flag}: {text!r}"
        assert "(default: None)" not in text, f"kvscope {command} {flag}: {text!r}"


def test_prompt_and_sampling_flags_have_help():
    texts = flag_help("generate")
    for flag in ("-p", "-s", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n"):
        assert not texts[flag].startswith(" (default"), f"{flag} has no help of its own"
    assert texts["--top-k"] == "keep only the K likeliest tokens (<= 0: off) (default: 40)"
    assert texts["-p"] == "the text to continue (default: Once upon a time)"
