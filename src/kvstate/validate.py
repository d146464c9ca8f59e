"""Checks of numeric arguments at the boundary: right type, finite, in range.

Validate-at-construction (the "parse, don't validate" habit): a config or component checks every
number once when it is built, so a NaN budget or a ``True`` slot count fails there with a message
naming the argument, instead of at first use or never. Plain functions, no torch import (token-id
tensors are checked through their ``shape`` / ``dtype`` / ``min`` / ``max``); the error class is the
caller's (``ValueError`` in pure modules, a :class:`kvstate.errors.KVStateError` elsewhere).
"""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, *,
              error: type[ValueError] = ValueError, hint: str = "") -> int:
    """``value`` as an int in ``[lo, hi]``; bools, floats and strings are refused (``2.0`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name}: must be an int{_range(lo, hi)}, got {value!r} ({type(value).__name__}){hint}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise error(f"{name}: must be an int{_range(lo, hi)}, got {v}{hint}")
    return v


def check_float(name: str, value: object, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False, error: type[ValueError] = ValueError,
                hint: str = "") -> float:
    """``value`` as a finite float in the range (ints accepted, bools / NaN / inf / complex refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name}: must be a finite number{_frange(lo, hi, lo_open, hi_open)}, got {value!r} "
                    f"({type(value).__name__}){hint}")
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        v = math.inf
    bad = not math.isfinite(v)
    bad = bad or (lo is not None and (v <= lo if lo_open else v < lo))
    bad = bad or (hi is not None and (v >= hi if hi_open else v > hi))
    if bad:
        raise error(f"{name}: must be a finite number{_frange(lo, hi, lo_open, hi_open)}, got {value!r}{hint}")
    return v


def check_bool(name: str, value: object, *, error: type[ValueError] = ValueError) -> bool:
    """``value`` as a bool; ints, strings and None are refused (``"no"`` is truthy)."""
    if not isinstance(value, bool):
        raise error(f"{name}: must be True or False, got {value!r} ({type(value).__name__})")
    return value


_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")


def check_token_ids(name: str, ids: object, vocab_size: int, *, max_len: int | None = None, batch: int | None = 1,
                    error: type[ValueError] = ValueError) -> tuple[int, int]:
    """A token-id tensor ``(batch, T)``: integer dtype, rank 2, ``batch`` rows (None: any), ``1 <= T <=
    max_len``, every id in ``[0, vocab_size)``; returns its shape. Works on torch tensors without importing
    torch."""
    shape, dtype = getattr(ids, "shape", None), str(getattr(ids, "dtype", "")).removeprefix("torch.")
    if shape is None or not hasattr(ids, "min"):
        raise error(f"{name}: must be a tensor of token ids of shape ({batch or 'B'}, T), got {type(ids).__name__}")
    if dtype not in _INT_DTYPES:
        raise error(f"{name}: token ids must have an integer dtype (torch.long), got {dtype or type(ids).__name__}")
    if len(shape) != 2:
        raise error(f"{name}: token ids must have shape ({batch or 'B'}, T), got rank {len(shape)} {tuple(shape)}")
    if batch is not None and int(shape[0]) != batch:
        raise error(f"{name}: batch size {int(shape[0])}; this API takes a batch of {batch} (shape ({batch}, T)) — "
                    "run one sequence at a time")
    t = int(shape[1])
    if t < 1 or (max_len is not None and t > max_len):
        raise error(f"{name}: {t} tokens; pass 1..{max_len if max_len is not None else 'T'} tokens"
                    f"{' (the model positions)' if max_len is not None else ''}")
    lo, hi = int(ids.min()), int(ids.max())  # type: ignore[attr-defined]
    if lo < 0 or hi >= vocab_size:
        raise error(f"{name}: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size}); tokenize "
                    "with the model's own tokenizer")
    return int(shape[0]), t


def check_id_list(name: str, ids: object, vocab_size: int, *, max_len: int | None = None,
                  error: type[ValueError] = ValueError) -> list[int]:
    """A list of token ids: 1..``max_len`` ints (not bools, not floats) in ``[0, vocab_size)``."""
    if not isinstance(ids, (list, tuple)):
        raise error(f"{name}: must be a list of token ids, got {type(ids).__name__}")
    if not ids or (max_len is not None and len(ids) > max_len):
        raise error(f"{name}: {len(ids)} token ids; pass 1..{max_len if max_len is not None else 'n'} "
                    f"{'(the model positions)' if max_len is not None else ''}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise error(f"{name}: token id {i!r} is not an int; pass integer token ids")
        if not 0 <= int(i) < vocab_size:
            raise error(f"{name}: token id {int(i)} is outside the vocabulary [0, {vocab_size}); tokenize with the "
                        "model's own tokenizer")
    return [int(i) for i in ids]


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in {lo}..{hi}"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""


def _frange(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is None and hi is None:
        return ""
    left = "-inf" if lo is None else f"{lo:g}"
    right = "inf" if hi is None else f"{hi:g}"
    return f" in {'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
