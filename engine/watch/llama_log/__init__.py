"""A real llama.cpp read from its own log (LLAMA_KV_CACHE_DEBUG=3 and debug logging): the engine's events,
made from the text. Torch-free, like the rest of the watch layer."""
from engine.watch.llama_log.parser import LlamaLogParser, ParserStats

__all__ = ["LlamaLogParser", "ParserStats"]
