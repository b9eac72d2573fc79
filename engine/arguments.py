"""Type checks of the arguments of kvscope's public calls, before anything changes.

llama.cpp's C API cannot receive a string where a sequence id is meant; Python can, and without these
checks such a value failed deep inside numpy with an error that named nothing (or, worse, numpy turned
"5" or 5.7 into 5). Each check names the call, the argument and the value it got.

What counts as what:
- an integer: int or any numpy integer. A bool is accepted as 0 or 1, because that is what C does
  with llama.cpp's integer parameters, and no call below gives that conversion a meaning it lacks in
  C. A float is refused even when whole (1.0): C would truncate 1.5 silently.
- a flag (a C bool): bool, numpy bool, or the integers 0 and 1. A batch's output flags are an int8
  array in llama.cpp: any integer there, nonzero meaning "output".
- a text setting: str.
"""
from __future__ import annotations

import numbers
import os
from collections.abc import Sequence

import numpy as np

from engine.errors import ArgumentTypeError


def _where(call: str) -> str:
    return f"{call}: " if call else ""


def int_arg(value, name: str, call: str = "") -> int:
    """value as an int, or ArgumentTypeError naming the argument."""
    if isinstance(value, (numbers.Integral, np.bool_)):  # int, bool, numpy integers
        return int(value)
    raise ArgumentTypeError(f"{_where(call)}{name} must be an int, got {value!r} ({type(value).__name__})")


def ints(call: str, **named) -> tuple[int, ...]:
    """Every named value as an int, in the order given: `seq_id, p0 = ints("seq_rm", seq_id=s, p0=p)`."""
    return tuple(int_arg(value, name, call) for name, value in named.items())


def optional_int(value, name: str, call: str = "") -> int | None:
    return None if value is None else int_arg(value, name, call)


def flag_arg(value, name: str, call: str = "") -> bool:
    """value as a bool: a bool, a numpy bool, or 0/1."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise ArgumentTypeError(f"{_where(call)}{name} must be True or False, got {value!r} ({type(value).__name__})")


def str_arg(value, name: str, call: str = "") -> str:
    if isinstance(value, str):
        return value
    raise ArgumentTypeError(f"{_where(call)}{name} must be a str, got {value!r} ({type(value).__name__})")


def bytes_arg(value, name: str, call: str = ""):
    """bytes, bytearray or memoryview, returned as given (no copy)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    raise ArgumentTypeError(f"{_where(call)}{name} must be bytes, got {type(value).__name__}")


def path_arg(value, name: str, call: str = "") -> str | os.PathLike:
    if isinstance(value, (str, os.PathLike)):
        return value
    raise ArgumentTypeError(f"{_where(call)}{name} must be a file path (str or pathlib.Path), got {value!r} "
                            f"({type(value).__name__})")


def int_array(values, name: str, call: str = "") -> np.ndarray:
    """A sequence of integers as an int64 array, checked as one numpy step (no loop per element)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ArgumentTypeError(f"{_where(call)}{name} must be a sequence of ints, got {type(values).__name__}")
    try:
        arr = np.asarray(values)
    except ValueError:  # ragged nesting
        arr = np.asarray(values, dtype=object)
    if arr.ndim != 1:
        raise ArgumentTypeError(f"{_where(call)}{name} must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iub":
        bad = next(v for v in values if not isinstance(v, (numbers.Integral, np.bool_)))
        i = next(i for i, v in enumerate(values) if v is bad)
        raise ArgumentTypeError(f"{_where(call)}{name}[{i}] must be an int, got {bad!r} ({type(bad).__name__})")
    return arr.astype(np.int64, copy=False)


def output_flags(values, name: str, call: str = "") -> np.ndarray:
    """A batch's logits flags as a bool array. llama.cpp's field is an int8 array in which any nonzero
    value asks for an output, so any integer (or bool) is accepted."""
    return int_array(values, name, call) != 0


def int_lists(values, name: str, call: str = "") -> tuple[tuple[int, ...], ...]:
    """A sequence of sequences of ints (a batch's seq ids per token) as tuples of ints."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ArgumentTypeError(f"{_where(call)}{name} must be a sequence of lists of ints, got "
                                f"{type(values).__name__}")
    out = []
    for i, ids in enumerate(values):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise ArgumentTypeError(f"{_where(call)}{name}[{i}] must be a list of ints, got {ids!r} "
                                    f"({type(ids).__name__})")
        out.append(tuple(int_arg(s, f"{name}[{i}][{k}]", call) for k, s in enumerate(ids)))
    return tuple(out)


def list_of(values, name: str, call: str, *, item: str, ok) -> list:
    """values as a list when each item passes ok(item); item says what one must be, for the message."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ArgumentTypeError(f"{_where(call)}{name} must be a list (each item {item}), got {values!r} "
                                f"({type(values).__name__})")
    for i, v in enumerate(values):
        if not ok(v):
            raise ArgumentTypeError(f"{_where(call)}{name}[{i}] must be {item}, got {v!r} ({type(v).__name__})")
    return list(values)


def str_list(values, name: str, call: str = "") -> list[str]:
    """A list of strings; a bare str is refused (it would be read letter by letter)."""
    return list_of(values, name, call, item="a str", ok=lambda v: isinstance(v, str))


def number_list(values, name: str, call: str = "") -> list[float]:
    """A list of real numbers (ints or floats, not bools), as floats."""
    return [float(v) for v in list_of(values, name, call, item="a number",
                                      ok=lambda v: isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)))]
