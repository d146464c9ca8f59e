"""The kvstate error hierarchy.

Every bad input raises one of these (or a plain ``ValueError`` from a pure module) with a message that
names the input, the problem and the fix. ``KVStateError`` subclasses ``ValueError`` so callers that
catch ``ValueError`` keep working.
"""


class KVStateError(ValueError):
    """Base class of every error kvstate raises on bad input."""


class UnsupportedModelError(KVStateError):
    """The model family is not one kvstate knows how to snapshot and restore."""


class ModelLoadError(KVStateError):
    """A model directory could not be read (missing, no config, not a causal LM)."""


class BudgetError(KVStateError):
    """A byte or slot budget cannot hold what was asked of it."""


class TraceFormatError(KVStateError):
    """A trace / payload file does not parse; the message names the line."""
