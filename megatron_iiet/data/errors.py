"""Error types of the data pipeline.

All derive from ValueError so callers that only care about "bad input" can catch one type; each
message names the offending file (and line or row where one exists).
"""

from megatron_iiet.errors import OperatorError


class DataInputError(OperatorError, ValueError):
    """An input file or argument cannot be used (missing, empty, undecodable, wrong field)."""


class CorruptDatasetError(OperatorError, ValueError):
    """An indexed dataset (.bin/.idx/.meta.json) is truncated, corrupted or inconsistent."""


class TokenizerMismatchError(OperatorError, ValueError):
    """Data made with one tokenizer is mixed with, or would be overwritten by, another's."""


class OutputWriteError(OperatorError, ValueError):
    """The output location cannot be written: permission denied, read-only, or full."""
