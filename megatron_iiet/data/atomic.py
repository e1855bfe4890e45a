"""Atomic file writes: write under a temporary name in the same directory, then rename.

A reader (or a resumed run) therefore sees either the complete old file, the complete new file, or
nothing; never a half-written one. Temporary names carry the writing process's pid and a random
token (`NAME.tmp-partial.PID-TOKEN`), so two processes writing the same file never share a temporary
file; they all start with `NAME.tmp-partial` so a cleanup can find the leftovers of a killed run.
Only a process holding the output's lock (megatron_iiet.locks) removes leftovers: whoever
wrote them does not hold it, so is dead or not one of ours.

OS errors of writing (permission denied, read-only file system, disk full) become one-line
`OutputWriteError`s naming the directory: `writing_to`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_iiet.data.errors import OutputWriteError
from megatron_iiet.storage import refusing_directory, storage_error

TMP_SUFFIX = ".tmp-partial"
_run_token: tuple[int, str] | None = None  # (pid, token): a forked child must not inherit its parent's


def _this_run() -> str:
    global _run_token
    if _run_token is None or _run_token[0] != os.getpid():
        _run_token = (os.getpid(), secrets.token_hex(4))
    return f"{_run_token[0]}-{_run_token[1]}"


def temp_path_for(path: str | os.PathLike) -> Path:
    """The temporary name under which this process writes `path` before the final rename."""
    path = Path(path)
    return path.with_name(f"{path.name}{TMP_SUFFIX}.{_this_run()}")


def _leftover_target(name: str) -> str | None:
    """The file name a temporary file is (or was) written for; None if `name` is not one."""
    target, suffix, run = name.partition(TMP_SUFFIX)
    return target if suffix and (not run or run.startswith(".")) else None


def temp_leftovers(path: str | os.PathLike) -> list[Path]:
    """Temporary files of `path` written by any process (this one included; also the older,
    run-less `NAME.tmp-partial`)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if _leftover_target(p.name) == path.name)


def commit_temp(path: str | os.PathLike) -> None:
    """Rename the temporary file of `path` onto `path` (atomic within one filesystem)."""
    tmp = temp_path_for(path)
    with open(tmp, "rb") as handle:  # flush file data before the rename makes it visible
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    tmp = temp_path_for(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_if_exists(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))


def remove_if_exists(*paths: str | os.PathLike) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def remove_with_leftovers(*paths: str | os.PathLike) -> None:
    """Remove files and every run's temporary leftovers of them; call only holding their lock.
    Each directory is listed once, however many files go (a merge removes every shard)."""
    names_by_directory: dict[Path, set[str]] = {}
    for path in map(Path, paths):
        names_by_directory.setdefault(path.parent, set()).add(path.name)
    for directory, names in names_by_directory.items():
        remove_if_exists(*(directory / name for name in names))
        if directory.is_dir():
            remove_if_exists(*(entry.path for entry in os.scandir(directory) if _leftover_target(entry.name) in names))


def _write_failure(error: OSError, directory: Path, reading: set[Path]) -> OutputWriteError | None:
    """The one-line error for an OSError met while writing into `directory` (full, read-only,
    forbidden: megatron_iiet.storage tells those apart), or None when it is not a storage fault
    of that directory: an unreadable input, or a file elsewhere, keeps its own error."""
    place = directory
    if error.filename:
        target = Path(error.filename).resolve()
        resolved_dir = directory.resolve()
        if target in reading:
            return None
        if not (target == resolved_dir or resolved_dir in target.parents or target in resolved_dir.parents):
            return None
        place = refusing_directory(error, directory)
    fault = storage_error(error, place)
    return None if fault is None else OutputWriteError(str(fault))


@contextlib.contextmanager
def writing_to(directory: str | os.PathLike, reading: Iterable[str | os.PathLike] = ()) -> Iterator[None]:
    """Turn OS errors of writing into `directory` into a one-line OutputWriteError; errors naming
    one of the files in `reading` (inputs, which may lie in that directory too) are left alone."""
    directory = Path(directory)
    read_paths = {Path(path).resolve() for path in reading}
    try:
        yield
    except OSError as error:
        mapped = _write_failure(error, directory, read_paths)
        if mapped is None:
            raise
        raise mapped from None
