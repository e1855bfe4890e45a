"""Storage faults an operator can fix (full disk, read-only or forbidden directory), told apart
from our bugs, so that they end in one line naming the directory instead of a traceback."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Optional

from megatron_iiet.errors import OperatorError

_OPERATOR_ERRNOS = {
    errno.ENOSPC: "no space left on {where}",
    errno.EDQUOT: "disk quota exceeded on {where}",
    errno.EROFS: "cannot write to {where}: read-only file system",
    errno.EACCES: "cannot write to {where}: permission denied",
    errno.EPERM: "cannot write to {where}: operation not permitted",
}
# Some writers (torch.distributed.checkpoint, worker processes) hand back only the text; torch's
# zip writer reports a full disk as a short write ("unexpected pos 704 vs 598").
_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES,
          "unexpected pos": errno.ENOSPC}


class StorageError(OperatorError, OSError):
    """A write failed for a reason outside the program; ``str()`` is the one-line reason."""

    def __init__(self, message: str, code: int):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _errno_in(exc: BaseException, seen: set) -> Optional[int]:
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in _OPERATOR_ERRNOS:
        return exc.errno
    nested = [exc.__cause__, exc.__context__, *(a for a in exc.args
                                                  if isinstance(a, BaseException))]
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.CheckpointException
    if isinstance(failures, dict):
        nested += [f for f in failures.values() if isinstance(f, BaseException)]
    for inner in nested:
        code = _errno_in(inner, seen)
        if code is not None:
            return code
    text = str(exc)
    return next((code for needle, code in _TEXTS.items() if needle in text), None)


def _nearly_full(where: str | Path) -> bool:
    """Less than 1 MiB left for us: a writer that lost the errno on the way failed for this."""
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 2**20


def storage_error(exc: BaseException, where: str | Path) -> Optional[StorageError]:
    """A StorageError naming ``where`` when ``exc`` (or what caused it) is a storage fault."""
    code = _errno_in(exc, set())
    if code is None and _nearly_full(where):
        code = errno.ENOSPC
    if code is None:
        return None
    return StorageError(_OPERATOR_ERRNOS[code].format(where=where), code)


def refusing_directory(error: OSError, default: str | Path) -> Path:
    """The directory a failed write names: the missing one mkdir could not create sits in an
    existing parent that refused; a file's own directory otherwise."""
    if not error.filename:
        return Path(default)
    path = Path(error.filename)
    return path if path.is_dir() else path.parent
