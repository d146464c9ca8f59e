"""Construction-time checks of :class:`kvstate.prefix.engine.SparsePrefixCache`'s numeric arguments.

A NaN budget compares false with everything, so a store built with it never evicts; a ``True`` slot
count or a float alignment slips through ``int()``. These checks run before anything is built and
raise :class:`~kvstate.errors.BudgetError` (budgets) or :class:`~kvstate.errors.KVStateError` naming the
argument and its allowed range.
"""

from __future__ import annotations

from kvstate.errors import BudgetError, KVStateError
from kvstate.validate import check_float, check_int


def check_engine_args(*, budget_bytes: object, slots_per_entry: object, align: object, alpha: object,
                      drift_threshold: object, gamma: object, block_size: object) -> None:
    check_int("budget_bytes", budget_bytes, 1, error=BudgetError, hint="; pass the store's byte budget as an int")
    check_int("slots_per_entry", slots_per_entry, 0, 2**20, error=KVStateError)
    if align is not None:
        check_int("align", align, 1, 2**31 - 1, error=KVStateError, hint="; None uses the model's chunk size")
    check_float("alpha", alpha, 0.0, 1e12, error=KVStateError)
    check_float("drift_threshold", drift_threshold, 0.0, 1.0, error=KVStateError)
    check_float("gamma", gamma, 0.0, 1.0, lo_open=True, error=KVStateError)
    check_int("block_size", block_size, 1, 2**31 - 1, error=KVStateError)
