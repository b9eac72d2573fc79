"""The `kvscope` command. Alone (or `kvscope tui ...`) it starts the terminal explorer; anything else is
one of the engine's commands (engine/cli.py). The engine never imports its front-ends, so the explorer
starts here, from the engine's own flags: a session built from them, a remote one, or a recording.

Without a terminal (a pipe, CI) the explorer prints its views as text frames for a bounded number of
steps and exits, so `kvscope` never waits for a key that cannot come."""
from __future__ import annotations

import argparse
import os
import sys

from engine import cli, llama_flags
from engine.errors import KvscopeError
from engine.runners.launch import open_source


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["attach"]:
        return cli.main(argv, explorer_app=explorer_app)
    if argv and argv[0] != "tui":
        return cli.main(argv)
    args = llama_flags.build_parser().parse_args(argv or ["tui"])
    try:
        return run_tui(args, demo=len(argv) <= 1)
    except KvscopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run_tui(args: argparse.Namespace, *, demo: bool) -> int:
    """The explorer on what the flags name (demo: the bundled model with the demo settings)."""
    interactive = sys.stdout.isatty() and sys.stdin.isatty()
    if args.replay and not interactive:
        raise KvscopeError("--replay needs a terminal: it is stepped by hand")
    source = open_source(args, demo=demo, threaded=interactive)
    try:
        if not interactive:
            from tui.plain import plain_frames

            try:
                steps = plain_frames(source.session, args.plain_steps, sys.stdout)
                print(f"kvscope: {steps} steps shown as text (no terminal); run kvscope in a terminal for the explorer")
            except BrokenPipeError:  # `kvscope | head`: the reader has what it wanted
                # what is still buffered goes nowhere, not into a second error when Python flushes at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        explorer_app()(source).run()
        return 0
    finally:
        source.close()


def explorer_app() -> type:
    """The terminal explorer's App class; a clear error where textual is missing."""
    try:
        from tui.app import KvscopeApp
    except ImportError as e:
        raise KvscopeError(f"the terminal explorer needs textual ({e}): pip install -e '.[tui]'") from None
    return KvscopeApp


if __name__ == "__main__":
    sys.exit(main())
