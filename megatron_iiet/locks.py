"""One writer per output: a run directory (training), a dataset prefix or a tokenizer model
(preprocessing). The second job refuses at once, naming the holder; it never waits.

The lock is a file created with O_EXCL, so of two jobs starting together exactly one wins, on
any filesystem that honours O_EXCL (local disks, NFSv3+, Lustre; unlike flock, which some
cluster mounts keep node-local). It records its holder (host, pid, process start time) and is
removed on release. A lock left behind by a killed job is stale when its host is this one and
its process is gone (the start time tells a reused pid apart); it is then replaced. A lock held
on another host cannot be checked from here: the refusal says whose it is and how to clear it.
A process may take a lock it already holds (the merge step of a preprocessing run).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from megatron_iiet.errors import OperatorError
from megatron_iiet.storage import refusing_directory, storage_error

LOCK_SUFFIX = ".lock"
DIRECTORY_LOCK = ".run.lock"
_held: dict[Path, int] = {}  # lock files this process holds -> how many times
# A forked child holds none of them: each names its holder's pid, which is the parent's.
os.register_at_fork(after_in_child=_held.clear)


class LockHeld(OperatorError, ValueError):
    """Another job holds the lock, or the lock cannot be written (the line says which)."""


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of an output file or prefix: TARGET.lock beside it."""
    return Path(str(target) + LOCK_SUFFIX)


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell reused pids apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start_time: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start_time is None or _start_time(pid) in (None, start_time)


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, "
            f"since {holder.get('since')}") if holder else "a job that has not written its name yet"


class FileLock:
    def __init__(self, path: str | Path, purpose: str):
        self.path = Path(path)
        self.purpose = purpose
        self.replaced_stale: Optional[dict] = None
        self._key: Optional[Path] = None

    def _record(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start_time": _start_time(pid),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "purpose": self.purpose}

    def holder(self) -> Optional[dict]:
        """Who holds the lock: {} when unreadable (being written), None when there is none."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            holder = json.loads(lines[-1])
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, IndexError):
            return {}

    def _is_stale(self, holder: dict) -> bool:
        if not holder:  # a job died between creating and writing it, or is writing it now
            try:
                return time.time() - self.path.stat().st_mtime > 60
            except FileNotFoundError:
                return True
        return holder.get("host") == socket.gethostname() and not _alive(
            int(holder.get("pid", -1)), holder.get("start_time"))

    def acquire(self, busy_message=None) -> "FileLock":
        """Take the lock or raise LockHeld; ``busy_message(holder)`` words the refusal."""
        key = self.path.resolve()
        if key in _held:
            _held[key] += 1
            self._key = key
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    holder = self.holder()
                    if holder is None:
                        continue  # released meanwhile
                    if not self._is_stale(holder):
                        message = (busy_message or self._busy)(holder)
                        raise LockHeld(message) from None
                    self._remove_stale(holder)
                    continue
                record = self._record()
                with os.fdopen(fd, "w") as f:
                    f.write(f"{self.purpose}: {describe(record)}\n{json.dumps(record)}\n")
                    f.flush()
                    os.fsync(f.fileno())
                _held[key] = 1
                self._key = key
                return self
        except OSError as err:
            fault = storage_error(err, refusing_directory(err, self.path.parent))
            if fault is None:
                raise
            with contextlib.suppress(OSError):
                if key not in _held:
                    self.path.unlink()  # created, but its holder could not be written
            raise LockHeld(str(fault)) from err
        raise LockHeld(f"{self.path}: could not be taken (it keeps changing)")

    def _remove_stale(self, holder: dict) -> None:
        # rename first: of two jobs replacing the same stale lock only one succeeds
        moved = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
        try:
            os.replace(self.path, moved)
        except FileNotFoundError:
            return
        moved.unlink(missing_ok=True)
        self.replaced_stale = holder

    def _busy(self, holder: dict) -> str:
        return (f"{self.path.parent} is in use by {holder.get('purpose', 'another job')} "
                f"({describe(holder)}); wait for it to finish or use another directory (if that "
                f"job is dead, remove {self.path})")

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        _held[key] -= 1
        if _held[key] == 0:
            del _held[key]
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def directory_lock(directory: str | Path, purpose: str) -> FileLock:
    """The lock of a whole run directory (logging or checkpoint directory of a training job)."""
    return FileLock(Path(directory) / DIRECTORY_LOCK, purpose)


@contextlib.contextmanager
def exclusive_output(target: str | os.PathLike, what: str, hint: str) -> Iterator[Path]:
    """Hold the lock of the output ``target`` for the block, else raise LockHeld naming the
    holder. ``what`` names the other job in the message ("another preprocessing run"), ``hint``
    says what to do."""
    lock = FileLock(lock_path(target), what.removeprefix("another ").strip())

    def busy(holder: dict) -> str:
        return f"{target}: busy: {what} holds {lock.path} ({describe(holder)}); {hint}"

    lock.acquire(busy)
    try:
        yield lock.path
    finally:
        lock.release()
