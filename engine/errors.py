"""Errors that kvscope raises on bad input. Each names what is wrong and, where possible, the fix."""
from __future__ import annotations


class KvscopeError(Exception):
    """Base class of every error kvscope raises on purpose."""


class ModelFileError(KvscopeError):
    """A model file or folder is missing, corrupt, truncated or inconsistent."""


class UnsupportedArchitectureError(ModelFileError):
    """The model's architecture is not one kvscope implements."""


class InvalidBatchError(KvscopeError):
    """A batch failed validation; decode() reports it as return code -1."""


class MemoryOperationError(KvscopeError):
    """A cache operation that llama.cpp would abort on; the cache is left unchanged."""


class ContextParamsError(KvscopeError):
    """Context settings that cannot work (bad sizes, types or combinations)."""


class BatchTooLargeError(KvscopeError):
    """A batch has more tokens than the context's n_batch (llama.cpp aborts; kvscope refuses)."""


class DeviceSpecError(KvscopeError, ValueError):
    """A device list, virtual device spec, layer count or tensor split that cannot be used."""


class ArgumentTypeError(KvscopeError, TypeError):
    """An argument of a public call has the wrong type (a str or float where an int is meant, ...).
    Raised before anything changes; the message names the call, the argument and the value."""
