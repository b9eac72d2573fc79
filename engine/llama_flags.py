"""llama.cpp's flag vocabulary: every flag kvscope's commands take, named and defaulted as in llama.cpp's
tools, and what they mean as settings (a Context's keyword arguments, a sampler's, a session's workload).
The `kvscope` command (engine/cli.py), the launcher (kvscope/launcher.py, engine/runners/launch.py) and the
notebook explorer (`Explorer("-m model.gguf -c 4096")`) all read flags here, so a flag means one thing
everywhere.

Torch-free on import: `kvscope --help` and a front-end that only watches a remote session or a recording
parse flags without loading torch. The checks that need the engine's device code (check_... below) import
it when they run.
"""
from __future__ import annotations

import argparse
import logging
import os
import re

from engine.errors import KvscopeError
from engine.kv.cells import MAX_SEQ
from engine.kv.slot_debug import ENV_VAR as KV_CACHE_DEBUG_ENV
from engine.kv.slot_debug import level_from_env
from engine.sizing.settings_aliases import (
    OFFLOAD_LAYERS_ENV,
    check_context_settings,
    check_swa_window,
    gpu_layers,
    parse_gpu_layers,
)
from engine.watch.protocol import DEFAULT_BIND, DEFAULT_PORT

log = logging.getLogger("kvscope.cli")

# A context setting (engine.Context's keyword) -> the llama.cpp flag that sets it, for texts that name a
# setting (the explorers' settings panels); tests/test_llama_flags.py checks each against the parser.
SETTING_FLAGS = {
    "n_ctx": "-c", "n_batch": "-b", "n_ubatch": "-ub", "n_seq_max": "-np", "kv_unified": "-kvu", "pad": "--pad",
    "type_k": "-ctk", "type_v": "-ctv", "flash_attn": "-fa", "swa_full": "--swa-full", "swa_window": "--swa-window",
    "devices": "--virtual-gpu", "n_gpu_layers": "-ngl", "tensor_split": "-ts", "offload_kqv": "-nkvo",
    "tensor_overrides": "-ot",
}

# llama.cpp flags kvscope refuses on purpose, with the reason shown next to the usage
REFUSED_FLAGS = {
    "-t": "threads", "--threads": "threads", "-tb": "threads for batches", "--threads-batch": "threads for batches",
}


def _add_context_flags(p: argparse.ArgumentParser, np_help: str = f"number of parallel sequences (1 to {MAX_SEQ})",
                       np_default: int = 1) -> None:
    p.add_argument("-m", "--model", default="demo",
                   help="GGUF file or Hugging Face folder (default: demo, the bundled demo model)")
    p.add_argument("-c", "--ctx-size", "--kvsize", dest="ctx_size", type=int, default=0,
                   help="KV cache size in cells, all sequences together (default 0: the model's n_ctx_train). "
                        "--kvsize is the name articles use; llama.cpp's is -c/--ctx-size")
    p.add_argument("--swa-window", type=int, default=None, metavar="N",
                   help="sliding window of a sliding-window model's caches instead of the model's own (an "
                        "experiment: the model was trained with its own window; memory and cell reuse follow N; "
                        "default: the model's window)")
    p.add_argument("-b", "--batch-size", type=int, default=2048,
                   help="logical batch size: the most tokens one decode takes (at least 1)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="physical batch size: the most tokens computed at once (at least 1)")
    p.add_argument("-np", "--parallel", type=int, default=np_default, help=np_help)
    p.add_argument("-kvu", "--kv-unified", action="store_true", help="one KV buffer shared by all sequences")
    p.add_argument("--pad", type=int, default=256,
                   help="cache size padding in cells (llama.cpp: always 256; smaller for teaching)")
    p.add_argument("-ctk", "--cache-type-k", default="f16",
                   help="K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl")
    p.add_argument("-ctv", "--cache-type-v", default="f16",
                   help="V cache type (quantized V needs flash attention: -fa on or auto)")
    p.add_argument("-fa", "--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="decides the V layout as in llama.cpp (off: V transposed)")
    p.add_argument("--swa-full", action="store_true", help="full-size SWA cache (sliding-window models)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"], help="compute dtype")
    _add_device_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=_gpu_layers, default=None,
                   help="layers to offload to the GPUs, the output layer counting as one ('all' or -1: every layer; "
                        "default: $LLAMA_OFFLOAD_LAYERS, else 0)")
    p.add_argument("-ts", "--tensor-split", type=_tensor_split, default=None,
                   help="share of the offloaded layers per GPU, e.g. 3,1 (default: by free memory)")
    p.add_argument("-nkvo", "--no-kv-offload", dest="offload_kqv", action="store_false",
                   help="keep the KV cache on the CPU even for offloaded layers")
    p.add_argument("--virtual-gpu", action="append", default=None, metavar="NAME=SIZE[,...]",
                   help="add virtual GPUs, e.g. VGPU0=2GiB or VGPU0=2GiB,VGPU1=1GiB (repeatable). Virtual: their "
                        "memory is host memory, "
                        "accounted against the given size. When given, only these GPUs are used (default: none; "
                        "the real GPUs found are used)")
    p.add_argument("-ot", "--override-tensor", dest="tensor_overrides", action="append", default=None,
                   metavar="REGEX=DEVICE,...",
                   help="put the weights whose llama.cpp name matches REGEX (searched, first match wins) on DEVICE "
                        "(CPU or a GPU's name), e.g. 'ffn_.*=CPU' (repeatable). Weights only: K/V follow -ngl. "
                        "Q/K/V and gate/up are one matrix each in kvscope and must go together (default: none)")


def _gpu_layers(text: str) -> int:
    """llama.cpp's -ngl: a number, or 'all' (every layer, -1)."""
    try:
        return parse_gpu_layers(text, "-ngl")
    except KvscopeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tensor_split(text: str) -> list[float]:
    """llama.cpp's -ts: comma- or slash-separated weights, one per GPU."""
    try:
        return [float(part) for part in re.split(r"[,/]", text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected weights like 3,1, got {text!r}") from None


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (<= 0: greedy, always the likeliest token)")
    p.add_argument("--top-k", type=int, default=40, help="keep only the K likeliest tokens (<= 0: off)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="keep the fewest likeliest tokens whose probabilities add up to P, in (0, 1] (1: off)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens less likely than P times the likeliest one, in [0, 1] (0: off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalise the tokens among the last --repeat-last-n ones, > 0 (1: off)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="how many recent tokens the repeat penalty looks at (0: off, -1: all)")


class ExactFlagParser(argparse.ArgumentParser):
    """Flags match only as written. argparse otherwise reads an unknown single-dash flag as the prefix
    of a known one (llama.cpp's "-t 4" would become "-ts 4"), even with allow_abbrev=False."""

    def _get_option_tuples(self, option_string: str) -> list:
        return []


class CommandParser(ExactFlagParser):
    """The top-level parser. A flag its subcommand does not know is reported with that subcommand's
    usage (argparse would show the top-level usage, which lists no flags at all)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}  # filled by build_parser

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            # "record generate" names the command that `record` runs, whose flags the usage should show
            name = " ".join(filter(None, (getattr(namespace, "command", None), getattr(namespace, "recorded", None))))
            parser = self.commands.get(name, self)
            parser.error(unrecognized_message(extras, parser.prog))
        return namespace


def unrecognized_message(extras: list[str], prog: str) -> str:
    """Which arguments are wrong, and why for the llama.cpp flags refused on purpose."""
    flags = [a.split("=", 1)[0] for a in extras if a.startswith("-") and not _is_number(a)]
    notes = [f"{flag} ({REFUSED_FLAGS[flag]}) is not supported: kvscope uses torch's threads (OMP_NUM_THREADS sets "
             f"how many)" for flag in flags if flag in REFUSED_FLAGS]
    unknown = [flag for flag in flags if flag not in REFUSED_FLAGS]
    if unknown:
        notes.append(f"{prog} has no flag {', '.join(unknown)}; `{prog} --help` lists its flags, and "
                     f"docs/coming-from-llama-cpp.md the llama.cpp flags kvscope does not support")
    if not flags:
        notes.append(f"{prog} takes flags only")
    return f"unrecognized arguments: {' '.join(extras)}\n" + "\n".join(notes)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless its text already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.nargs == 0:  # a switch: given or not
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvscope", allow_abbrev=False, description="kvscope: a live explorer of LLM KV caches")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ExactFlagParser)

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, allow_abbrev=False, formatter_class=DefaultsHelpFormatter, **kwargs)

    _add_generate_flags(command("generate", help="generate text and print llama.cpp's logs"))
    _add_parallel_flags(command("parallel", help=PARALLEL_HELP))
    est = command("estimate", help="memory per device for a model and context settings, from the file headers only")
    _add_context_flags(est)
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument("--fit", action="store_true",
                     help="propose the largest -ngl, then the largest -c, that fit the devices (-ngl is ignored)")
    est.add_argument("-fitt", "--fit-target", type=int, default=0, metavar="MiB",
                     help="with --fit: MiB to leave free on every GPU (default 0; llama.cpp's is 1024)")
    est.add_argument("-fitc", "--fit-ctx", type=int, default=0, metavar="N",
                     help="with --fit: the smallest context it may propose; layers are fitted at this context")
    tiny = command("make-tiny-model", help="write a tiny random llama (HF folder and GGUF) for demos")
    tiny.add_argument("folder")
    _add_serve_flags(command("serve", help=SERVE_HELP))
    _add_server_sim_flags(command("server-sim", help=SERVER_SIM_HELP))
    _add_tui_flags(command("tui", help="the terminal explorer (what `kvscope` alone starts, on the demo model)"))
    _add_attach_flags(command("attach", help=ATTACH_HELP, usage=ATTACH_USAGE))
    record = command("record", help="run generate or parallel and record every event to a file "
                                    "(docs/recording-format.md)")
    record.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="the recording to write, e.g. run.kvtrace; an existing file is replaced (no default: "
                             "required)")
    record.add_argument("--keyframe-every", type=int, default=1000, metavar="K",
                        help="store the whole cache state every K events, so that a viewer seeks fast")
    recorded = record.add_subparsers(dest="recorded", required=True, parser_class=ExactFlagParser,
                                     metavar="{generate,parallel}")
    commands = dict(sub.choices)
    for name, add_flags, text in (("generate", _add_generate_flags, "kvscope generate, recorded"),
                                  ("parallel", _add_parallel_flags, "kvscope parallel, recorded")):
        nested = recorded.add_parser(name, allow_abbrev=False, formatter_class=DefaultsHelpFormatter, help=text)
        add_flags(nested)
        commands[f"record {name}"] = nested
    parser.commands = commands
    return parser


SERVER_SIM_HELP = ("llama-server's slots on the cache: scripted multi-turn chats with prompt reuse, context checkpoints "
                   "and the re-processing warning, in the server's own log lines (docs/server-sim.md)")


def _add_server_sim_flags(p: argparse.ArgumentParser) -> None:
    _add_context_flags(p, np_default=2, np_help="number of slots (llama-server's -np; slot i uses sequence i)")
    _add_sampling_flags(p)
    _add_server_policy_flags(p)
    p.add_argument("--context-shift", action="store_true",
                   help="when a slot is full, discard half of it after --keep tokens and go on")
    p.add_argument("--keep", type=int, default=0, help="tokens of the prompt a context shift keeps (-1: all)")


def _add_server_policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", default=None, metavar="FILE",
                   help="server: the conversations to run, a JSON script (docs/server-sim.md; default: the built-in "
                        "demo script, two users on two slots)")
    p.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.10,
                   help="how much of a prompt an idle slot's kept tokens must share for the slot to be chosen "
                        "(0: choose the least recently used)")
    p.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="reuse chunks of at least N tokens from further on in a slot's cache by shifting them "
                        "(needs a cache that can shift; 0: off)")
    p.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", dest="ctx_checkpoints", type=int, default=32,
                   metavar="N", help="context checkpoints per slot (0: none)")
    p.add_argument("-cms", "--checkpoint-min-step", type=int, default=8192, metavar="N",
                   help="fewest tokens between two checkpoints of a prompt's user messages")
    p.add_argument("-cram", "--cache-ram", type=int, default=8192, metavar="MiB",
                   help="host memory for the prompt cache, where idle slots' states are saved and loaded from "
                        "(-1: no limit, 0: no prompt cache)")
    p.add_argument("--no-cache-idle-slots", dest="cache_idle_slots", action="store_false",
                   help="do not save idle slots to the prompt cache when a task starts")


PARALLEL_HELP = "N clients answering a stream of requests with continuous batching (llama.cpp's parallel example)"


def _add_generate_flags(gen: argparse.ArgumentParser) -> None:
    _add_context_flags(gen)
    _add_sampling_flags(gen)
    gen.add_argument("-p", "--prompt", default="Once upon a time", help="the text to continue")
    gen.add_argument("-n", "--n-predict", type=int, default=64,
                     help="tokens to generate per sequence (-1: until end of generation or a full context; 0: "
                          "evaluate the prompt only)")
    gen.add_argument("--context-shift", action="store_true",
                     help="when a sequence's context is full, discard half of it after the first --keep tokens "
                          "and go on (llama-completion's rule)")
    gen.add_argument("--keep", type=int, default=0,
                     help="tokens of the prompt to keep on a context shift (-1 = the whole prompt; BOS is always "
                          "kept)")


def _add_parallel_flags(par: argparse.ArgumentParser) -> None:
    _add_context_flags(par, np_default=4, np_help=f"number of clients (1 to {MAX_SEQ - 1}: one sequence more holds "
                                                   f"the shared system prompt)")
    _add_sampling_flags(par)
    par.add_argument("-ns", "--sequences", type=int, default=16, help="number of requests to simulate")
    par.add_argument("-n", "--n-predict", type=int, default=64,
                     help="most tokens a request may generate (each request draws its budget from [N/4, N])")
    par.add_argument("--arrival-gap", type=int, default=2,
                     help="mean number of steps between two request arrivals (0: all arrive at once)")
    par.add_argument("--system-prompt", default=None, help="the shared system prompt (default: a built-in one)")
    par.add_argument("--no-pps", dest="pps", action="store_false",
                     help="do not share the system prompt: every request decodes it in its own sequence")
    par.add_argument("--steps", action="store_true", help="print one line per step (batch, decodes, cache use)")
    _add_slot_flags(par)


def _add_slot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slot-ctx", type=int, default=0, metavar="N",
                   help="each client's own context in positions, as llama-server's slots (0: none but the "
                        "cache's); a client that fills it stops, or shifts with --context-shift")
    p.add_argument("--context-shift", action="store_true",
                   help="when a client fills its --slot-ctx, discard half of its positions after --keep "
                        "and go on (llama-server's context shift)")
    p.add_argument("--keep", type=int, default=0,
                   help="positions kept on a context shift (-1: the whole prompt, system prompt included)")


SERVE_HELP = "run a session (a model, a context, a workload) and serve it to RemoteSession clients over ZeroMQ"


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    _add_session_flags(p)
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help="the interface to listen on: 127.0.0.1 is this machine only; 0.0.0.0 is every interface")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="the command port; events go out on the port after it")
    p.add_argument("--token", default=None,
                   help="the token every command must carry (default: $KVSCOPE_TOKEN, else a random one printed at "
                        "start); on the command line every user of the machine sees it in `ps`, so prefer "
                        "KVSCOPE_TOKEN")
    p.add_argument("--no-token", action="store_true",
                   help="accept commands without a token: only with --bind 127.0.0.1, and then every user of this "
                        "machine can drive the session and write in its state folder (a warning says so)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="the folder for the files clients name in save_state, load_state and chat scripts; absolute "
                        "paths, '..' and links leading out of it are refused (default: kvscope-state/ in the "
                        "current folder, made on first use, mode 0700)")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="the folder load_model takes names in (a GGUF file or a Hugging Face folder inside it); "
                        "without it clients can load only the bundled 'demo' (default: none)")
    from engine.watch.kv_events.formats import DIALECTS

    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="also publish the cache as vLLM publishes its prefix cache (KV events: BlockStored, "
                        "BlockRemoved, AllBlocksCleared of hashed blocks) on a ZeroMQ PUB socket listening on "
                        "ENDPOINT, e.g. tcp://*:5557 as vLLM's default or tcp://127.0.0.1:5557 (port *: a free one); "
                        "it carries every prompt's token ids to whoever connects, without any token (default: off)")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="with --kv-events: a ROUTER socket that resends the last 10000 batches from a sequence "
                        "number on request, as vLLM's replay_endpoint (default: none)")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="with --kv-events: tokens per block, as vLLM's --block-size")
    p.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="with --kv-events: the topic frame of every message (default: empty, as vLLM's)")
    p.add_argument("--kv-events-dialect", default="map", choices=DIALECTS,
                   help="with --kv-events: the wire layout: map is vLLM's current one (32-byte hashes; an iSWA "
                        "model's sliding-window cache as KV cache group 1), array-v3 the previous one, array-v2 and "
                        "array-v1 older ones with 64-bit integer hashes (array-v1 as SGLang sends)")


def _add_tui_flags(p: argparse.ArgumentParser) -> None:
    _add_session_flags(p)
    p.add_argument("--attention", action="store_true",
                   help="publish each sequence's attention over the cells after every decode (the a overlay)")
    p.add_argument("--replay", default=None, metavar="FILE", help="show a recording (kvscope record) instead of a session")
    p.add_argument("--connect", default=None, metavar="ADDRESS",
                   help="drive a remote session (kvscope serve), e.g. tcp://gpu-box:5590")
    p.add_argument("--token", default=None,
                   help="with --connect: the token the server printed (default: $KVSCOPE_TOKEN)")
    p.add_argument("--plain-steps", type=int, default=30, metavar="N",
                   help="without a terminal (a pipe, CI): print N steps as text frames, then exit")


ATTACH_HELP = ("watch a real llama.cpp's KV cache from its own debug log: a command run here (llama-server, "
               "llama-cli, ...) or a saved log; or vLLM / SGLang workers' prefix caches from their KV events (--vllm) "
               "(docs/command-line.md)")
ATTACH_USAGE = ("kvscope attach [-o FILE] [--passthrough FILE] [--seconds N] -- COMMAND [ARG ...]\n"
                "       kvscope attach --log FILE [--follow] [-o FILE] [--seconds N]\n"
                "       kvscope attach --vllm tcp://HOST:5557[,tcp://HOST:5600] [ENDPOINT[,REPLAY] ...] [--topic T] "
                "[--tokenizer PATH] [--capacity-blocks N] [-o FILE] [--seconds N]")


def _add_attach_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log", default=None, metavar="FILE",
                   help="read a saved llama.cpp log (its stderr, written with LLAMA_KV_CACHE_DEBUG=3 and -v) instead "
                        "of running a command (default: none: run the command after --)")
    p.add_argument("--follow", action="store_true",
                   help="with --log: keep reading as the file grows, like tail -f (a truncated or replaced file is "
                        "read again from its start, as a new log)")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="record to FILE (a .kvtrace) with no explorer, until the log's end, the command's exit, "
                        "--seconds, Ctrl-C or SIGTERM (default: open the explorer)")
    p.add_argument("--keyframe-every", type=int, default=1000, metavar="K",
                   help="with -o: store the whole cache state every K events, so that a viewer seeks fast")
    p.add_argument("--passthrough", default=None, metavar="FILE",
                   help="where the command's raw output (stdout and stderr, as they came) goes (default: a "
                        "temporary file, named at start and kept)")
    p.add_argument("--seconds", type=float, default=None, metavar="N",
                   help="stop after N seconds, ending the command (default: no limit)")
    p.add_argument("--plain-every", type=float, default=1.0, metavar="SECONDS",
                   help="without a terminal and without -o: print a text frame at most this often while the cache "
                        "changes")
    p.add_argument("--vllm", nargs="+", action="extend", default=None, metavar="ENDPOINT[,REPLAY]",
                   help="watch vLLM or SGLang workers' prefix caches from the KV events they publish (vLLM's "
                        "--kv-events-config with publisher zmq) instead of a llama.cpp: each ENDPOINT is a worker's "
                        "PUB socket, tcp://HOST:5557, and ,REPLAY its replay endpoint, tcp://HOST:5600, which resends "
                        "batches kvscope missed; with data parallelism each rank publishes on the port + its rank: give "
                        "them all (default: none)")
    p.add_argument("--topic", default="", metavar="T",
                   help="with --vllm: the publishers' topic (vLLM's kv-events-config topic; default: empty, as vLLM's)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="with --vllm: the model's tokenizer.json, Hugging Face folder or GGUF file, read here (nothing is "
                        "downloaded), so that views show the blocks' tokens as text (default: token ids only)")
    p.add_argument("--capacity-blocks", type=int, default=0, metavar="N",
                   help="with --vllm: the blocks each worker holds at most (vLLM's num_gpu_blocks: the tokens its log "
                        "gives as 'GPU KV cache size' over its block size), for views that show how full a cache is "
                        "(default: 0, not known)")
    p.add_argument("run", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the llama.cpp command to run, after `--`; kvscope adds LLAMA_KV_CACHE_DEBUG=3 to its "
                        "environment and -v to its arguments unless it has -v or -lv N (N >= 1), and ends it when "
                        "it stops")


def _add_session_flags(p: argparse.ArgumentParser) -> None:
    _add_context_flags(p, np_default=4, np_help=f"sequences of the context (idle, generate), or clients of the parallel "
                                                f"workload (1 to {MAX_SEQ - 1}; it takes one sequence more)")
    _add_sampling_flags(p)
    p.add_argument("--workload", default="idle", choices=["idle", "generate", "parallel", "server"],
                   help="what runs between commands: idle (a prompt is decoded at once; the cache is yours), generate "
                        "(prompts generate together), parallel (clients answering a stream of requests), server "
                        "(llama-server's slots running the conversations of --chat; -np slots)")
    p.add_argument("-p", "--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt to add at start (repeatable; default: none)")
    p.add_argument("-n", "--n-predict", type=int, default=64,
                   help="tokens per prompt (-1: until end of generation); parallel: the most a request may generate")
    p.add_argument("--context-shift", action="store_true",
                   help="generate: when a sequence's context is full, discard half of it after --keep tokens and go "
                        "on; parallel: the same when a client fills its --slot-ctx")
    p.add_argument("--keep", type=int, default=0,
                   help="tokens of the prompt kept on a context shift (-1: the whole prompt)")
    p.add_argument("--slot-ctx", type=int, default=0, metavar="N",
                   help="parallel: each client's own context in positions, as llama-server's slots (0: none but the "
                        "cache's)")
    p.add_argument("-ns", "--sequences", type=int, default=16, help="parallel: requests of the simulated stream")
    p.add_argument("--arrival-gap", type=int, default=2, help="parallel: mean number of steps between two arrivals")
    p.add_argument("--system-prompt", default=None, help="parallel: the shared system prompt (default: a built-in one)")
    p.add_argument("--no-pps", dest="pps", action="store_false", help="parallel: do not share the system prompt")
    _add_server_policy_flags(p)
    p.add_argument("--speed", type=float, default=0.0, metavar="STEPS_PER_S",
                   help="steps per second while running (0: as fast as possible)")
    p.add_argument("--start", action="store_true", help="run at once (else paused until start)")




# ---- flags -> settings ------------------------------------------------------------------------------
def virtual_gpus(args: argparse.Namespace) -> list[str] | None:
    """--virtual-gpu as a list of NAME=SIZE, whether given repeatedly or as one comma-separated list
    (VGPU0=2GiB,VGPU1=1GiB, as the explorers' settings field takes it); None when not given."""
    if args.virtual_gpu is None:
        return None
    return [part.strip() for given in args.virtual_gpu for part in given.split(",") if part.strip()]


def context_settings(args: argparse.Namespace) -> dict:
    """A Context's keyword arguments, as the flags give them (unchecked)."""
    return dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size, n_seq_max=args.parallel,
                kv_unified=args.kv_unified, pad=args.pad, type_k=args.cache_type_k, type_v=args.cache_type_v,
                flash_attn=args.flash_attn, swa_full=args.swa_full, devices=virtual_gpus(args),
                n_gpu_layers=args.n_gpu_layers, tensor_split=args.tensor_split, offload_kqv=args.offload_kqv,
                tensor_overrides=args.tensor_overrides, swa_window=args.swa_window)


def sampler_settings(args: argparse.Namespace) -> dict:
    """engine.sampling.SamplerParams' fields, as the sampling flags give them."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def workload_settings(args: argparse.Namespace) -> dict:
    """engine.runners.workloads.WorkloadSpec's fields, as the session flags (serve, tui) give them."""
    from engine.runners.parallel_workload import DEFAULT_SYSTEM_PROMPT

    return dict(kind=args.workload, n_predict=args.n_predict, n_clients=args.parallel, n_sequences=args.sequences,
                arrival_gap=args.arrival_gap, schedule_seed=args.seed,
                system_prompt=DEFAULT_SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt,
                share_system_prompt=args.pps, context_shift=args.context_shift, n_keep=args.keep,
                n_ctx_slot=args.slot_ctx, sampler=sampler_settings(args), chat=args.chat or "",
                slot_prompt_similarity=args.slot_prompt_similarity, cache_reuse=args.cache_reuse,
                ctx_checkpoints=args.ctx_checkpoints, checkpoint_min_step=args.checkpoint_min_step,
                cache_ram_mib=args.cache_ram, cache_idle_slots=args.cache_idle_slots)


# ---- checks before loading: the context's own checks, run while no model is needed -----------------
def checked_context_settings(args: argparse.Namespace, n_seq_max: int, *, ignores_gpu_layers: bool = False) -> dict:
    """The context's keyword arguments, after every check that needs no model, so that a bad setting is
    told at once rather than after the load. n_seq_max: the sequences the context gets."""
    if args.parallel < 1:
        raise KvscopeError(f"-np must be >= 1, got {args.parallel}")
    check_context_settings(n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                           n_seq_max=n_seq_max, pad=args.pad, type_k=args.cache_type_k, type_v=args.cache_type_v,
                           flash_attn=args.flash_attn)
    check_swa_window(args.swa_window)
    kwargs = context_settings(args)
    kwargs["n_seq_max"] = n_seq_max
    kwargs["n_gpu_layers"] = _checked_gpu_layers(args, kwargs["devices"], ignores_gpu_layers)
    return kwargs


def _checked_gpu_layers(args: argparse.Namespace, devices: list[str] | None, ignored_anyway: bool) -> int:
    """-ngl (or $LLAMA_OFFLOAD_LAYERS) after checking the device flags; 0, with llama.cpp's warning, when
    there is no GPU to offload to. The context would ignore the layers too; given 0, it does not warn
    a second time."""
    from engine.placement.devices import check_tensor_split, no_gpu_warning_lines, resolve_gpus
    from engine.placement.weight_devices import parse_tensor_overrides

    n_gpu_layers = gpu_layers(args.n_gpu_layers)
    gpus = resolve_gpus(devices)
    check_tensor_split(gpus, args.tensor_split)
    parse_tensor_overrides(args.tensor_overrides, gpus)
    if ignored_anyway:
        return n_gpu_layers
    from_env = args.n_gpu_layers is None and os.environ.get(OFFLOAD_LAYERS_ENV, "").strip()
    setting = f"{OFFLOAD_LAYERS_ENV}={from_env}" if from_env else "--gpu-layers option"
    lines = no_gpu_warning_lines(n_gpu_layers, gpus, setting=setting, virtual_gpu="--virtual-gpu VGPU0=2GiB")
    for line in lines:
        log.warning("%s", line)
    return 0 if lines else n_gpu_layers


def hint_kv_cache_debug(verbose: bool) -> None:
    """LLAMA_KV_CACHE_DEBUG's dump is made of debug lines, which only -v shows: say so once, at start.
    Reading the level here also refuses a value that is not a number before the model is loaded."""
    level = level_from_env()
    if level > 0 and not verbose:
        log.warning("warning: %s=%d: the find_slot dump is printed at debug level; add -v to see it",
                    KV_CACHE_DEBUG_ENV, level)


def sampler_params(args: argparse.Namespace):
    """The sampling flags as engine.sampling.SamplerParams (which checks them)."""
    from engine.sampling import SamplerParams

    return SamplerParams(**sampler_settings(args))


def workload_spec(args: argparse.Namespace):
    """The session flags' engine.runners.workloads.WorkloadSpec, checked before anything loads."""
    from engine.runners.parallel_workload import check_system_prompt
    from engine.runners.workloads import WorkloadSpec

    settings = workload_settings(args)
    if args.workload == "parallel":
        if args.parallel >= MAX_SEQ:
            raise KvscopeError(f"-np must be <= {MAX_SEQ - 1} for the parallel workload, got {args.parallel}: it takes "
                               f"one sequence more for the shared system prompt, and a context holds at most {MAX_SEQ}")
        if args.sequences < 0:
            raise KvscopeError(f"--sequences must be >= 0, got {args.sequences}")
        check_system_prompt(settings["system_prompt"], args.pps)
    if args.cache_ram < -1:
        raise KvscopeError(f"--cache-ram must be >= -1 (-1: no limit, 0: no prompt cache), got {args.cache_ram}")
    if args.workload == "server" and args.chat:
        from engine.runners.server.conversations import load_script

        load_script(args.chat)  # a bad script is told before the model loads
    return WorkloadSpec(**settings)  # it makes (and checks) the SamplerParams of the sampler's settings


def session_settings(args: argparse.Namespace) -> tuple[dict, object]:
    """The context settings and WorkloadSpec of the session flags (serve, tui), checked before any load."""
    spec = workload_spec(args)
    settings = checked_context_settings(args, max(spec.n_seq_max_needed(), args.parallel))
    if getattr(args, "attention", False):
        settings["publish_attention"] = True
    hint_kv_cache_debug(args.verbose)
    return settings, spec


def begin_session(session, args: argparse.Namespace) -> None:
    """What the session flags ask of a session once it is open: their prompts (-p), then --start."""
    for prompt in args.prompt or []:
        session.add_prompt(prompt).result()
    if args.start:
        session.start().result()
