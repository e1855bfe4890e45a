"""Error types of the data pipeline.

All derive from ValueError so callers that only care about "bad input" can catch one type; each
message names the offending file (and line or row where one exists).
"""


class DataInputError(ValueError):
    """An input file or argument cannot be used (missing, empty, undecodable, wrong field)."""


class CorruptDatasetError(ValueError):
    """An indexed dataset (.bin/.idx/.meta.json) is truncated, corrupted or inconsistent."""


class TokenizerMismatchError(ValueError):
    """Data made with one tokenizer is mixed with, or would be overwritten by, another's."""


class OutputWriteError(ValueError):
    """The output location cannot be written: permission denied, read-only, or full."""
