"""`kvscope attach --vllm ENDPOINT[,REPLAY] ...`: vLLM or SGLang workers' prefix caches, watched from the KV events
they publish (engine/watch/kv_events/subscriber.py): recorded (-o, no view), in the terminal explorer, or as text
frames without a terminal (engine/runners/kv_events_frames.py). It runs until --seconds, SIGINT or SIGTERM (and q
in the explorer): a publisher has no end of its own.

Exit status 0 when asked to stop; errors (a bad endpoint, a tokenizer that cannot be read, flags that do not go
together) are KvscopeError: `error: ...` and exit status 1, as every kvscope command's."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable

from engine.errors import KvscopeError
from engine.runners.attach_command import check_watch_flags, watch_until_stopped

# flags of `kvscope attach` that watch a llama.cpp, with what they are when not given
LLAMA_CPP_FLAGS = (("--log", "log", None), ("--follow", "follow", False), ("--passthrough", "passthrough", None))
KV_EVENT_FLAGS = (("--topic", "topic", ""), ("--tokenizer", "tokenizer", None), ("--capacity-blocks", "capacity_blocks", 0))


def check_kv_event_flags(args: argparse.Namespace) -> None:
    """With --vllm, no flag of a llama.cpp attach; without it, none of --vllm's own."""
    if args.vllm:
        given = [flag for flag, name, unset in LLAMA_CPP_FLAGS if getattr(args, name) != unset]
        if given:
            raise KvscopeError(f"attach: {' and '.join(given)} {'is' if len(given) == 1 else 'are'} for a llama.cpp's "
                               f"log; --vllm watches vLLM / SGLang KV event publishers: give one or the other")
        run = [a for a in args.run if a != "--"]
        if run:
            raise KvscopeError(f"attach: --vllm watches publishers that run elsewhere: kvscope runs no command with it "
                               f"(got {' '.join(run)})")
        if args.capacity_blocks < 0:
            raise KvscopeError(f"attach: --capacity-blocks must be >= 0, got {args.capacity_blocks}")
        return
    given = [flag for flag, name, unset in KV_EVENT_FLAGS if getattr(args, name) != unset]
    if given:
        raise KvscopeError(f"attach: {' and '.join(given)} {'goes' if len(given) == 1 else 'go'} with --vllm ENDPOINT "
                           f"(a vLLM or SGLang KV event publisher)")


def run_kv_events_attach(args: argparse.Namespace, explorer_app: Callable[[], type] | None = None) -> int:
    """`kvscope attach --vllm ...` with its parsed flags; returns the exit status. explorer_app: what loads the
    terminal explorer's App class (without it, a terminal gets text frames too)."""
    from engine.watch.kv_events.subscriber import KvEventSubscriber, parse_endpoint

    check_kv_event_flags(args)
    check_watch_flags(args)
    try:
        endpoints = [parse_endpoint(text) for text in args.vllm]
    except KvscopeError as e:
        raise KvscopeError(f"attach --vllm: {e}") from None
    vocabulary = None
    if args.tokenizer is not None:
        from engine.watch.kv_events.vocabulary import load_vocabulary

        try:
            vocabulary = load_vocabulary(args.tokenizer)
        except KvscopeError as e:
            raise KvscopeError(f"attach --tokenizer: {e}") from None
    interactive = not args.output and sys.stdout.isatty() and sys.stdin.isatty()
    explorer = explorer_app() if interactive and explorer_app is not None else None  # a missing textual, told first
    # Not started yet: the recording and the views subscribe first, and get every event from the first batch.
    subscriber = KvEventSubscriber(endpoints, topic=args.topic, vocabulary=vocabulary,
                                   capacity_blocks=args.capacity_blocks, start=False)
    from engine.runners.kv_events_frames import print_block_frames
    from engine.watch.sources import kv_events_source

    def say_started() -> None:
        print(f"kvscope attach: {subscriber.status.message}" + (f" (topic {args.topic!r})" if args.topic else "")
              + (f", token texts of {vocabulary.model_name}" if vocabulary is not None else ""), file=sys.stderr)

    watch_until_stopped(args, subscriber, explorer, make_recorder=functools.partial(_recorder, args, subscriber),
                        make_source=lambda: kv_events_source(subscriber), print_frames=print_block_frames,
                        say_started=say_started)
    _say_how_it_ended(subscriber)
    if subscriber.error is not None:
        raise KvscopeError(subscriber.status.message)
    return 0


def _recorder(args: argparse.Namespace, subscriber):
    """The recording -o names, with what was watched in its header, subscribed before the subscriber starts."""
    from engine.watch.recording import Recorder

    info = {"command": "attach", "vllm": [str(e) for e in subscriber.endpoints], "topic": subscriber.topic,
            "tokenizer": args.tokenizer or "", "capacity_blocks": subscriber.capacity_blocks}
    recorder = Recorder(args.output, args.keyframe_every, info=info)
    recorder.attach(subscriber)
    recorder.start()
    return recorder


def _say_how_it_ended(subscriber) -> None:
    """The last status and each publisher's counts, on stderr."""
    print(f"kvscope attach: {subscriber.status.message}", file=sys.stderr)
    for endpoint, s in subscriber.stats.items():
        missed = s.lost + s.replayed
        print(f"kvscope attach: {endpoint}: {s.batches} batches, {s.blocks_stored} blocks stored, {s.blocks_removed} "
              f"removed; {missed} batches missed ({s.replayed} replayed, {s.lost} lost), {s.malformed} malformed, "
              f"{s.epochs - 1} restarts" + (f"; {s.dialect}" if s.dialect else ""), file=sys.stderr)
