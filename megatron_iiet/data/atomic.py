"""Atomic file writes: write under a temporary name in the same directory, then rename.

A reader (or a resumed run) therefore sees either the complete old file, the complete new file, or
nothing; never a half-written one. The temporary names share one suffix so a cleanup can find
leftovers of a killed run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp-partial"


def temp_path_for(path: str | os.PathLike) -> Path:
    """The temporary name under which `path` is written before the final rename."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


def commit_temp(path: str | os.PathLike) -> None:
    """Rename the temporary file of `path` onto `path` (atomic within one filesystem)."""
    tmp = temp_path_for(path)
    with open(tmp, "rb") as handle:  # flush file data before the rename makes it visible
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    tmp = temp_path_for(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def remove_if_exists(*paths: str | os.PathLike) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
