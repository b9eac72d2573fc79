"""The `kvscope` command prints llama.cpp's init and perf lines and streams the text."""
from __future__ import annotations

import re
import subprocess
import sys

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
                 "--context-shift", "--keep"):
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
