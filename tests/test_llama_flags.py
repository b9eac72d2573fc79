"""engine/llama_flags.py, the one place where llama.cpp's flags become settings: parsing and help never
load torch, every context setting it names is set by the flag it names, and --virtual-gpu takes a list."""
from __future__ import annotations

import argparse
import json

import pytest

from engine import llama_flags
from engine.llama_flags import SETTING_FLAGS, build_parser, context_settings
from tests.test_import_without_torch import run_python

COMMANDS = ("generate", "parallel", "estimate", "make-tiny-model", "serve", "server-sim", "tui", "record",
            "record generate")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_answers_without_torch(command):
    """`kvscope --help` (and every command's) must not wait seconds for torch to load."""
    argv = [*command.split(), "--help"]
    done = run_python(f"""
        from kvscope.launcher import main
        try:
            main({argv!r})
        except SystemExit as e:
            assert e.code == 0, e.code
        else:
            raise AssertionError("--help did not exit")
        assert "torch" not in sys.modules or sys.modules["torch"] is None
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: kvscope {command}".rstrip() + " ")
    assert "options:" in done.stdout


def test_a_recording_opens_from_flags_without_torch(tmp_path):
    """A front-end on a machine without torch opens `kvscope tui --replay FILE`'s source (and parses
    --connect's flags) through the same launcher as a local session."""
    path = tmp_path / "t.kvtrace"
    done = run_python(f"""
        from engine import events as ev
        from engine.runners.launch import parse_tui_flags, source_from_flags
        from engine.watch.recording import Recorder
        created = ev.ContextCreated(cache="kv", n_ctx=8, n_ctx_seq=8, kv_size=8, n_stream=1, n_seq_max=1, n_layer=1,
                                    type_k="f16", type_v="f16", v_trans=False, k_bytes=1, v_bytes=1, n_batch=8,
                                    n_ubatch=8, pad=8, unified=True, model_name="m", log_lines=())
        with Recorder({str(path)!r}, keyframe_every=1) as rec:
            rec.write(created)
        assert parse_tui_flags("--connect tcp://gpu-box:5590 --token t").connect == "tcp://gpu-box:5590"
        source = source_from_flags(["--replay", {str(path)!r}])
        source.close()
        print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
    """)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.llama_flags", "engine.runners.launch"} <= loaded
    assert not loaded & {"engine.context", "engine.runners.session", "engine.cli"}, loaded


# a value for every flag of SETTING_FLAGS that differs from its default (None: a switch)
FLAG_VALUES = {"-c": "100", "-b": "7", "-ub": "3", "-np": "3", "-kvu": None, "--pad": "32", "-ctk": "q8_0",
               "-ctv": "q4_0", "-fa": "on", "--swa-full": None, "--swa-window": "5", "--virtual-gpu": "V=1GiB",
               "-ngl": "2", "-ts": "3,1", "-nkvo": None, "-ot": "ffn_.*=CPU"}


def test_every_named_setting_is_set_by_its_flag():
    assert set(FLAG_VALUES) == set(SETTING_FLAGS.values())
    parser = build_parser()
    default = context_settings(parser.parse_args(["tui"]))
    assert set(SETTING_FLAGS) == set(default), "context_settings and SETTING_FLAGS name the same settings"
    for name, flag in SETTING_FLAGS.items():
        value = FLAG_VALUES[flag]
        changed = context_settings(parser.parse_args(["tui", flag] if value is None else ["tui", flag, value]))
        differing = {key for key in default if changed[key] != default[key]}
        assert differing == {name}, f"{flag} {value or ''} changed {differing}, not {name}"


def test_the_settings_panels_name_the_flags_of_the_parser():
    from engine.watch.settings_form import SETTINGS

    options = {option for action in build_parser().commands["tui"]._actions for option in action.option_strings}
    for name, _, what in SETTINGS:
        if name in SETTING_FLAGS and name != "pad":
            assert SETTING_FLAGS[name] in what and SETTING_FLAGS[name] in options, (name, what)


@pytest.mark.parametrize("given", [
    ["--virtual-gpu", "VGPU0=64MiB,VGPU1=32MiB"],
    ["--virtual-gpu", "VGPU0=64MiB", "--virtual-gpu", "VGPU1=32MiB"],
    ["--virtual-gpu", "VGPU0=64MiB, VGPU1=32MiB,"],
])
def test_virtual_gpus_as_a_list_or_repeated(given):
    args = build_parser().parse_args(["estimate", *given])
    assert llama_flags.virtual_gpus(args) == ["VGPU0=64MiB", "VGPU1=32MiB"]
    assert context_settings(args)["devices"] == ["VGPU0=64MiB", "VGPU1=32MiB"]


def test_no_virtual_gpu_is_none():
    assert llama_flags.virtual_gpus(argparse.Namespace(virtual_gpu=None)) is None


def test_a_listed_pair_of_virtual_gpus_takes_a_tensor_split(tiny_llama_gguf, capsys):
    """The README's `-ts` example: two virtual GPUs given as one list are the same two GPUs as given
    one by one, and both take layers."""
    from engine.cli import main

    def estimate(*gpu_flags: str) -> dict:
        rc = main(["estimate", "-m", str(tiny_llama_gguf), "-c", "256", *gpu_flags, "-ngl", "all", "-ts", "1,1",
                   "--json"])
        out = capsys.readouterr().out
        assert rc == 0, out
        found = json.loads(out)
        for device in found["devices"]:  # the host's free memory moves between two runs
            device.pop("free")
        return found

    listed = estimate("--virtual-gpu", "VGPU0=64MiB,VGPU1=64MiB")
    devices = {d["device"]: d for d in listed["devices"]}
    assert devices["VGPU0"]["model_bytes"] > 0 and devices["VGPU1"]["model_bytes"] > 0
    repeated = estimate("--virtual-gpu", "VGPU0=64MiB", "--virtual-gpu", "VGPU1=64MiB")
    assert listed == repeated
