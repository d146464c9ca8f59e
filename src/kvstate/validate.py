"""Checks of numeric arguments at the boundary: right type, finite, in range.

Validate-at-construction (the "parse, don't validate" habit): a config or component checks every
number once when it is built, so a NaN budget or a ``True`` slot count fails there with a message
naming the argument, instead of at first use or never. Plain functions, no torch; the error class is
the caller's (``ValueError`` in pure modules, a :class:`kvstate.errors.KVStateError` elsewhere).
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
