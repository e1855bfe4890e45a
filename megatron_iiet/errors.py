"""The one distinction every entry point makes: the operator's mistake or the machine's fault
(bad input, a full disk, a busy directory) against our bug.

An ``OperatorError`` is reported as one line, ``error: ...``, with exit status 2 and no
traceback; anything else keeps its traceback. The concrete errors (CheckpointError, LockHeld,
StorageError, the data pipeline's and the conversion's) derive from it, and from ValueError or
OSError so that callers catching those still do.
"""


class OperatorError(Exception):
    """A fault the operator can fix; ``str()`` is the whole message."""


class BadInput(OperatorError, ValueError):
    """Bad input found before training starts (config, data, checkpoint): one line."""


class ReportedByRank0(OperatorError, ValueError):
    """An operator error that rank 0 found, raised on the other ranks with the same line."""
