"""The kvstate error hierarchy.

Every bad input raises one of these (or a plain ``ValueError`` from a pure module) with a message that
names the input, the problem and the fix. ``KVStateError`` subclasses ``ValueError`` so callers that
catch ``ValueError`` keep working. The CLI prints any of them as one line on stderr and exits with 2.
"""


class KVStateError(ValueError):
    """Base class of every error kvstate raises on bad input."""


class UnsupportedModelError(KVStateError):
    """The model family is not one kvstate knows how to snapshot and restore."""


class ModelLoadError(KVStateError):
    """A model directory could not be read (missing, no config, not a causal LM, missing weights)."""


class ModelConfigError(ModelLoadError):
    """A model config with impossible values (non-positive dimensions, inconsistent layer lists, unknown dtype)."""


class IntegrityError(ModelLoadError):
    """A file does not match the checksum its directory's manifest recorded, or its header is corrupt."""


class BudgetError(KVStateError):
    """A byte or slot budget cannot hold what was asked of it."""


class TraceFormatError(KVStateError):
    """A trace / payload file does not parse; the message names the line."""


class OutputError(KVStateError):
    """An output path that cannot be written, or that holds earlier output and no ``overwrite`` was given."""


class InputFileError(KVStateError):
    """An input file that cannot be opened or read (missing, a directory, no permission, not UTF-8)."""
