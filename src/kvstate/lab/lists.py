"""Comma-separated option values: the one parser behind every list option of the command line.

``--length 512,1K,4096``, ``--keep 1,0.5``, ``--task niah_single,qa``: each value is split on commas and
checked whole before any work starts. Refused, with a :class:`ListOptionError` naming the option, the
bad value and an example of a good one: an empty list or an empty item (``"512,,1024"``), a value given
twice (``1K`` and ``1024`` are the same value; raise ``--n`` for more items instead), a number that
is not plain ASCII digits (``str.isdigit()`` accepts ``"²"``, which ``int()`` then rejects; ``int()`` alone
accepts ``"1_000"``, ``"+5"`` and non-ASCII digits), and a value out of range.
Ignored: quoting (no value here holds a comma) and units other than ``K`` (= 1024) on integers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from kvstate.errors import KVStateError

_INT = re.compile(r"(-?[0-9]+)([kK]?)")  # ASCII digits only; the sign is read so "-1" gets a range message
_FLOAT = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


class ListOptionError(KVStateError):
    """A list option's value is empty, repeats an item, does not parse, or holds an item out of range."""


def _items(value: str, option: str, example: str) -> list[str]:
    items = [v.strip() for v in value.split(",")]
    if not value.strip():
        raise ListOptionError(f"{option} {value!r} is empty; pass one value or a comma-separated list, e.g. "
                              f"{option} {example}")
    if "" in items:
        raise ListOptionError(f"{option} {value!r} has an empty item; separate values by single commas, e.g. "
                              f"{option} {example}")
    return items


def _unique(values: list, items: list[str], option: str, example: str) -> None:  # type: ignore[type-arg]
    seen: dict[object, str] = {}
    for v, item in zip(values, items, strict=True):
        if v in seen:
            same = f" ({seen[v]!r} and {item!r} are the same value)" if seen[v] != item else ""
            raise ListOptionError(f"{option}: {item!r} given more than once{same}; list each value once, e.g. "
                                  f"{option} {example} (raise --n for more items per value)")
        seen[v] = item


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"<= {hi:g}"


def parse_ints(value: str, option: str, *, lo: int | None = 1, hi: int | None = None,
               example: str = "512,1K,4096") -> list[int]:
    """``"512,1K,2k,4096"`` -> ``[512, 1024, 2048, 4096]`` (``K`` = x1024), each in ``lo..hi``."""
    items = _items(value, option, example)
    out = []
    for item in items:
        m = _INT.fullmatch(item)
        if m is None:
            raise ListOptionError(f"{option} {item!r} is not a whole number; pass ASCII digits with an optional K "
                                  f"(x1024), e.g. {option} {example}")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise ListOptionError(f"{option} {item!r} = {n:,} is out of range: each value must be "
                                  f"{_range_text(lo, hi)}; e.g. {option} {example}")
        out.append(n)
    _unique(out, items, option, example)
    return out


def parse_floats(value: str, option: str, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, example: str = "1,0.5,0.25") -> list[float]:
    """``"1,0.5,.25"`` -> ``[1.0, 0.5, 0.25]``, each in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    items = _items(value, option, example)
    out = []
    for item in items:
        if _FLOAT.fullmatch(item) is None:
            raise ListOptionError(f"{option} {item!r} is not a decimal number; pass numbers such as "
                                  f"{option} {example}")
        x = float(item)
        below = lo is not None and (x <= lo if lo_open else x < lo)
        if not math.isfinite(x) or below or (hi is not None and x > hi):
            raise ListOptionError(f"{option} {item!r} is out of range: each value must be "
                                  f"{_range_text(lo, hi, lo_open)}; e.g. {option} {example}")
        out.append(x)
    _unique(out, items, option, example)
    return out


def parse_names(value: str, option: str, choices: Collection[str] | None = None, *,
                example: str | None = None) -> list[str]:
    """``"niah_single,qa"`` -> ``["niah_single", "qa"]``, each one of ``choices`` (any name if ``None``)."""
    shown = example or ",".join(list(choices or ["name"])[:2])
    items = _items(value, option, shown)
    if choices is not None:
        for item in items:
            if item not in choices:
                raise ListOptionError(f"{option} {item!r} is unknown; choose from {', '.join(choices)} "
                                      f"(e.g. {option} {shown})")
    _unique(items, items, option, shown)
    return items
