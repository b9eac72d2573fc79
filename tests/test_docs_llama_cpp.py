"""docs/coming-from-llama-cpp.md stays honest: the flags it lists as supported are accepted by the
CLI for the commands it names, the environment variables it lists are read by the engine, and the
flags it lists as not supported are rejected (argparse's exit code 2). The "Which llama.cpp" box of
docs/how-the-kv-cache-works.md and notebook 1 names the commit and the defaults llama.cpp's own binaries
report, where they are found."""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.llama_flags import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "coming-from-llama-cpp.md"
COMMANDS = ("generate", "parallel", "estimate")
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
ENV = re.compile(r"`(LLAMA_[A-Z_]+)`")


def sections() -> dict[str, str]:
    """'## ' heading -> its text."""
    parts = re.split(r"^## ", DOC.read_text(encoding="utf-8"), flags=re.M)
    return {p.splitlines()[0].strip(): p for p in parts[1:]}


def section(word: str) -> str:
    return "\n".join(text for title, text in sections().items() if word.lower() in title.lower())


def table_rows(text: str, column: str) -> list[dict[str, str]]:
    """Rows of every markdown table in text whose header has `column`."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = cells
        elif set(line.replace("|", "").strip()) <= set("-: "):
            continue
        elif column in header:
            rows.append(dict(zip(header, cells)))
    return rows


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def supported_flags() -> list[tuple[str, str]]:
    out = []
    for row in table_rows(section("Flags"), "kvscope flag"):
        flags = [f for span in code_spans(row["kvscope flag"]) for f in FLAG.findall(span.split()[0])
                 if span.startswith("-")]
        cmds = [c.strip() for c in row["commands"].split(",")]
        out += [(cmd, flag) for cmd in cmds for flag in flags]
    return out


def unsupported_argvs() -> list[list[str]]:
    argvs = []
    for row in table_rows(section("Not supported"), "llama.cpp flag"):
        for span in code_spans(row["llama.cpp flag"]):
            words = span.split()
            argvs.append(words if len(words) > 1 else words + ["1"])
    return argvs


def parse(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, ""


def sample_value(cmd: str, flag: str) -> list[str]:
    sub = build_parser()._subparsers._group_actions[0].choices[cmd]
    action = sub._option_string_actions[flag]
    if action.nargs == 0:
        return []
    if action.choices:
        return [list(action.choices)[0]]
    return {"-ngl": ["all"], "--virtual-gpu": ["VGPU0=64MiB"], "-ot": ["ffn_down=CPU"]}.get(flag, ["1"])


def test_the_page_lists_flags_and_commands():
    pairs = supported_flags()
    assert len(pairs) > 60
    assert {cmd for cmd, _ in pairs} == set(COMMANDS)
    assert ("estimate", "--fit") in pairs and ("generate", "--context-shift") in pairs
    assert len(unsupported_argvs()) > 20


@pytest.mark.parametrize("cmd,flag", supported_flags())
def test_supported_flag_is_accepted(cmd, flag):
    sub = build_parser()._subparsers._group_actions[0].choices[cmd]
    assert flag in sub._option_string_actions, f"kvscope {cmd} has no {flag}"
    action = sub._option_string_actions[flag]
    argv = [cmd, flag, *sample_value(cmd, action.option_strings[0])]
    rc, err = parse(argv)
    assert rc == 0, f"{argv}: {err}"


@pytest.mark.parametrize("argv", unsupported_argvs(), ids=" ".join)
@pytest.mark.parametrize("cmd", COMMANDS)
def test_unsupported_flag_is_rejected(cmd, argv):
    rc, _ = parse([cmd, *argv])
    assert rc == 2, f"kvscope {cmd} {' '.join(argv)} was accepted"


def engine_sources() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "engine").rglob("*.py"))


def test_supported_environment_variables_are_read():
    names = [ENV.search(row["variable"]).group(1) for row in table_rows(section("Environment"), "variable")]
    assert names == ["LLAMA_KV_CACHE_DEBUG", "LLAMA_OFFLOAD_LAYERS"]
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "os.environ" in text:
            names = [n for n in names if f'"{n}"' not in text]
    assert not names, f"listed as supported but never read next to os.environ: {names}"


def test_the_window_override_the_pages_give_names_the_demo_models_key():
    """--swa-window is kvscope's name; the pages give llama.cpp's way instead, a metadata override of the key
    llama.cpp reads the window from (`<arch>.attention.sliding_window`, src/llama-arch.cpp)."""
    from engine.formats.gguf_file import read_gguf_metadata

    metadata = read_gguf_metadata(ROOT / "engine" / "models" / "demo" / "kvscope-demo-gemma3.gguf")
    key = f"{metadata['general.architecture']}.attention.sliding_window"
    assert metadata[key] == 64
    for page in (DOC, README, ROOT / "notebooks" / "07-debugging-stories.ipynb"):
        assert f"--override-kv {key}=int:" in page.read_text(encoding="utf-8"), page.name


def test_unsupported_environment_variables_are_not_read():
    text = section("Not supported")
    names = [n for n in ENV.findall(text) if not n.endswith("_")]
    assert "LLAMA_BATCH_DEBUG" in names and "LLAMA_ATTN_ROT_DISABLE" in names
    source = engine_sources()
    assert not [n for n in names if f'"{n}"' in source]
    assert '"LLAMA_ARG_' not in source


# ---- what users can open: no citations of a document they do not have ----------------------------------------
README = ROOT / "README.md"
USER_DOCS = [README, *sorted((ROOT / "docs").rglob("*.md"))]
PRIVATE_CITATION = re.compile(r"spec(?:s|ification)?\s*(?:sections?|§)|§\s*\d", re.I)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_only_what_users_can_open(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if PRIVATE_CITATION.search(line)]
    assert not hits, "cite llama.cpp's source (src/llama-kv-cache.cpp, ...) or kvscope's docs instead:\n" + \
        "\n".join(hits)


# ---- the README's set-up commands ---------------------------------------------------------------------------
def setup_commands() -> list[str]:
    text = README.read_text(encoding="utf-8").split("## Set up and go", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def test_readme_has_two_setup_commands_and_running_needs_no_test_dependencies():
    run_cmd, test_cmd = setup_commands()  # exactly two
    assert run_cmd == "pip install torch==2.13.0 && pip install -e '.[tui]' && kvscope"  # the explorer on the demo
    assert "[dev]" not in run_cmd
    assert test_cmd == "pip install torch==2.13.0 && pip install -e '.[dev]' && python -m pytest"


def test_ci_runs_the_readmes_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert setup_commands()[1] in ci_lines


def test_every_quirk_the_events_carry_is_documented():
    from engine.kv import cache

    quirks = {name for name in dir(cache) if name.startswith("QUIRK_")}
    assert {"QUIRK_DRY_RUN_HEADS", "QUIRK_DRY_RUN_PURGE", "QUIRK_DIV_SHIFT"} <= quirks
    text = section("QUIRKs")
    assert [q for q in sorted(quirks) if f"`{q}`" not in text] == []


# ---- "Which llama.cpp": the box at the top of docs/how-the-kv-cache-works.md and of notebook 1 -----------------
HOW_IT_WORKS = ROOT / "docs" / "how-the-kv-cache-works.md"
NOTEBOOK_1 = ROOT / "notebooks" / "01-what-a-kv-cache-is.ipynb"
LLAMA_CPP_COMMIT = "0c1e570"
LLAMA_CPP_SOURCE = re.compile(r"`((?:src|common|tools|include|ggml)/[\w/.-]+)`")


def which_llama_cpp_boxes() -> tuple[str, str]:
    """(the page's box, notebook 1's box): the blockquote that opens each."""
    import nbformat

    page = HOW_IT_WORKS.read_text(encoding="utf-8").split("\n\n")[1]
    cells = nbformat.read(NOTEBOOK_1, as_version=4).cells
    notebook = cells[1].source if cells[1].cell_type == "markdown" else ""
    return page, notebook


def test_the_which_llama_cpp_box_opens_the_page_and_notebook_1_alike():
    page, notebook = which_llama_cpp_boxes()
    for box in (page, notebook):
        assert box.startswith("> **Which llama.cpp.** kvscope follows llama.cpp at commit `" + LLAMA_CPP_COMMIT + "`")
        assert all(line.startswith(">") for line in box.splitlines())
        bullets = re.split(r"\n> - ", box)[1:]
        assert 4 <= len(bullets) <= 7
        assert all(LLAMA_CPP_SOURCE.search(bullet) for bullet in bullets), "each bullet names llama.cpp's file"
    assert LLAMA_CPP_SOURCE.findall(page) == LLAMA_CPP_SOURCE.findall(notebook)


LLAMA_BIN = Path(os.environ.get("KVSCOPE_LLAMA_BIN") or Path(shutil.which("llama-server") or "").parent)
LLAMA_SERVER = LLAMA_BIN / "llama-server"
needs_llama_server = pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                                        reason="no llama-server: set KVSCOPE_LLAMA_BIN to its folder "
                                               "(docs/watching-llama-cpp.md says how to build it)")


def llama_server(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LLAMA_SERVER), *argv], capture_output=True, text=True, timeout=60, check=False)


@needs_llama_server
def test_llama_server_is_the_commit_the_box_names():
    out = llama_server("--version")
    assert f"commit {LLAMA_CPP_COMMIT})" in out.stdout + out.stderr


@needs_llama_server
def test_llama_servers_defaults_are_the_boxs():
    """Each option of `llama-server --help` by its first name, its text on one line."""
    text = llama_server("--help").stdout
    options = {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in re.split(r"\n(?=-)", text)}
    expected = {
        "-ngl": "'auto', or 'all' (default: auto)",
        "-c": "(default: 0, 0 = loaded from model)",
        "-fit": "default: 'on'",
        "-fitc": "default: 4096",
        "-np": "(default: -1, -1 = auto)",
        "-kvu": "(default: enabled if number of slots is auto)",
        "--context-shift": "(default: disabled)",
        "--swa-full": "(default: false)",
        "-ctxcp": "(default: 32)",
        "-fa": "default: 'auto'",
    }
    wrong = {flag: options.get(flag) for flag, default in expected.items() if default not in options.get(flag, "")}
    assert not wrong, wrong
    bare = llama_server("-fa")  # older posts' bare -fa: the flag now takes on, off or auto
    assert bare.returncode != 0 and "expected value for argument" in bare.stdout + bare.stderr
