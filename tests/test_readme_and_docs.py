"""The README and the pages under docs/ say what kvscope does: their links lead somewhere, their commands parse
and the ones that place layers on GPUs run, their addresses use `kvscope serve`'s port, the numbers they give
for the demo's window are the code's, and the measurements live on one page (docs/performance.md), out of
the README a newcomer reads first."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from engine import cli, llama_flags

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LESSON_COPIES = sorted((ROOT / "docs" / "lessons").glob("*.md"))  # the notebooks rendered by tools/render_lessons.py
LINK = re.compile(r"\]\(([^)\s]+)\)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slugs(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES + LESSON_COPIES, ids=rel)
def test_relative_links_lead_to_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in slugs(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{rel(page)}: {broken}"


# ---- the measurements: one page, linked from the README -------------------------------------------------------
PERFORMANCE = ROOT / "docs" / "performance.md"


def table_rows(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.startswith("|") and not set(line.replace("|", "").strip()) <= set("-: ")]


def test_the_measurements_are_on_their_own_page_and_the_readme_links_it() -> None:
    assert "](docs/performance.md)" in README.read_text(encoding="utf-8")
    text = PERFORMANCE.read_text(encoding="utf-8")
    for measured in ("tok/s", "events/s", "MiB", "bench/decode.py", "bench/soak.py"):
        assert measured in text, measured
    assert len(table_rows(text)) > 20


def test_the_readme_repeats_no_measurement() -> None:
    readme = README.read_text(encoding="utf-8")
    numbers = set(re.findall(r"\d+\.\d+ (?:tok/s|ms|MiB|events/s)", PERFORMANCE.read_text(encoding="utf-8")))
    assert numbers
    assert not [n for n in numbers if n in readme]
    assert not [row for row in table_rows(PERFORMANCE.read_text(encoding="utf-8")) if row in readme]


# ---- addresses: the port `kvscope serve` listens on -----------------------------------------------------------
ADDRESS = re.compile(r"tcp://[\w.\-]+:(\d+)")
KV_EVENT_LINE = re.compile(r"--vllm|--kv-events|vllm=|KV events")


def test_the_pages_give_kvscope_serves_default_port() -> None:
    from engine.watch.protocol import DEFAULT_PORT

    # vLLM's and SGLang's KV event publishers have ports of their own (docs/watching-vllm.md)
    found = {(rel(p), int(port)) for p in PAGES if p.name != "watching-vllm.md"
             for line in p.read_text(encoding="utf-8").splitlines() if not KV_EVENT_LINE.search(line)
             for port in ADDRESS.findall(line)}
    assert (rel(README), DEFAULT_PORT) in found
    assert {port for _, port in found} == {DEFAULT_PORT}, sorted(found)
    readme = README.read_text(encoding="utf-8")
    explorer_addresses = re.findall(r'Explorer\("(tcp://[^"]+)"[,)]', readme)
    assert explorer_addresses and all(a.endswith(f":{DEFAULT_PORT}") for a in explorer_addresses)


# ---- the demo's window -------------------------------------------------------------------------------------------
def test_the_readme_gives_the_model_window_and_the_demo_window_the_code_uses() -> None:
    from engine.runners.demo import DEMO_SETTINGS, demo_session
    from engine.runners.session import Session

    text = " ".join(README.read_text(encoding="utf-8").split())
    model_window = int(re.search(r"The model's own window is (\d+) positions", text).group(1))
    demo_window = int(re.search(r"the demo workload that `kvscope` and `Explorer\(\)` run narrows it to (\d+)",
                                text).group(1))
    session = Session("demo", threaded=False)
    try:
        assert session.ctx.memory.swa.layout.n_swa == session.model.config.n_swa == model_window
    finally:
        session.close()
    assert DEMO_SETTINGS["swa_window"] == demo_window != model_window
    demo = demo_session(threaded=False)
    try:
        assert demo.ctx.memory.swa.layout.n_swa == demo_window
    finally:
        demo.close()


# ---- the commands ----------------------------------------------------------------------------------------------
def shell_commands(page: Path) -> list[str]:
    """The kvscope command lines of the page's sh blocks: continuation lines joined, the comment after `#`
    dropped by shlex later."""
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        joined: list[str] = []
        for line in block.splitlines():
            if joined and (joined[-1].endswith("\\") or (line[:1].isspace() and not line.strip().startswith("#"))):
                joined[-1] = joined[-1].rstrip("\\") + " " + line.strip()
            elif line.strip() and not line[:1].isspace():
                joined.append(line)
        commands += [c for c in joined if re.match(r"^([A-Z_]+=\S+ )*kvscope\b", c)]
    return commands


def argv_of(command: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment, kvscope's arguments with the optional [...] parts included, what follows a pipe)."""
    command = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).replace("|", " "), command)  # [a | b]: both
    words = shlex.split(command, comments=True)
    env = {}
    while "=" in words[0] and words[0] != "kvscope":
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words.pop(0) == "kvscope", command
    piped = words[words.index("|"):] if "|" in words else []
    words = [w for w in words[:len(words) - len(piped)] if w != "..." and not re.match(r"^\d?>", w)]
    return env, words, piped


COMMANDS = [(page, c) for page in PAGES for c in shell_commands(page)]


def test_the_pages_have_commands() -> None:
    assert len([c for page, c in COMMANDS if page == README]) >= 4
    assert len({page for page, _ in COMMANDS}) >= 3


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{rel(p)}: {c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_parses(page: Path, command: str, capsys) -> None:
    _, argv, _ = argv_of(command)
    try:
        llama_flags.build_parser().parse_args(argv or ["tui"])  # `kvscope` alone is `kvscope tui`
    except SystemExit as e:
        pytest.fail(f"{rel(page)}: `{command}` is refused: {capsys.readouterr().err.strip()} (exit {e.code})")


PLACEMENT_VALUES = {"--virtual-gpu", "-ngl", "-ts", "-ot"}
PLACEMENT_FLAGS = {"-nkvo"}
TENSOR_SPLITS = [(page, c) for page, c in COMMANDS if "-ts" in argv_of(c)[1]]


def test_tensor_split_is_documented() -> None:
    assert [c for page, c in TENSOR_SPLITS if page == README]


@pytest.mark.parametrize("page,command", TENSOR_SPLITS, ids=[f"{rel(p)}: {c[:60]}" for p, c in TENSOR_SPLITS])
def test_a_documented_tensor_split_places_the_demo_model(page: Path, command: str, capsys) -> None:
    """`-ts` needs one weight per GPU: the command's placement flags, given to `kvscope estimate` on the demo
    model, place its layers on as many GPUs as the split has weights."""
    _, argv, _ = argv_of(command)
    placement: list[str] = []
    for i, word in enumerate(argv):
        if word in PLACEMENT_VALUES:
            placement += argv[i:i + 2]
        elif word in PLACEMENT_FLAGS:
            placement.append(word)
    rc = cli.main(["estimate", *placement])
    out = capsys.readouterr()
    assert rc == 0, f"{rel(page)}: `{command}`: {out.err.strip()}"
    weights = placement[placement.index("-ts") + 1].split(",")
    assert len(re.findall(r"^\S+ \(virtual\)", out.out, flags=re.M)) == len(weights), out.out


def test_a_piped_debug_dump_sends_stderr_down_the_pipe(capfd, monkeypatch) -> None:
    """llama.cpp's logs and the LLAMA_KV_CACHE_DEBUG dump go to stderr, as llama.cpp's do: a documented
    command that pipes the dump into another program must send stderr down the pipe (`2>&1`)."""
    piped = [(page, c) for page, c in COMMANDS if "LLAMA_KV_CACHE_DEBUG" in c and argv_of(c)[2]]
    assert piped
    for page, command in piped:
        assert "2>&1 |" in command, f"{rel(page)}: `{command}` pipes stdout only; the dump is on stderr"
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")
    assert cli.main(["generate", "-p", "And God said", "-n", "1", "-v", "-c", "256"]) == 0
    out, err = capfd.readouterr()
    assert "find_slot: stream[0]" in err and "find_slot" not in out
