"""The `kvscope` command prints llama.cpp's init and perf lines and streams the text."""
from __future__ import annotations

import re
import subprocess
import sys

import engine
from engine.cli import main


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
