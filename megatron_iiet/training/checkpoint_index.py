"""What a checkpoint root holds, read from plain files (no megatron import): which `iter_*`
directories are complete and intact, which one a resume starts from, and why a broken one is
broken.

A checkpoint is complete when its `meta.json` parses and every file its manifest lists (name and
size, recorded at commit) is present with that size: a truncated `.distcp`, `common.pt` or RNG
file, or a missing one, makes it broken. Checkpoints written before manifests existed are judged
by their `meta.json` alone.

The manifest also records each file's checksum (`checksums`, xxh3-128: ~0.1 s for a 630 MiB
checkpoint, little next to writing it; docs/benchmarks.md); `verify_checksums` compares them
before a load, so a same-size change inside a shard is refused too. Listing checkpoints checks
sizes only, which is cheap; checkpoints written before checksums existed are checked by size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_iiet.errors import OperatorError

LATEST = "latest"
META = "meta.json"
PARTIAL_SUFFIX = ".partial"
MANIFEST_KEY = "files"
CHECKSUMS_KEY = "checksums"
CHECKSUM_ALGORITHM = "xxh3_128"
_HASH_CHUNK = 16 << 20
_ITER = re.compile(r"iter_(\d{7})")


class CheckpointError(OperatorError, ValueError):
    pass


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


def step_of(path: Path) -> Optional[int]:
    match = _ITER.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: Path) -> list[Path]:
    """Every committed `iter_*` directory (complete or broken), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and p.is_dir()]
    return sorted(found, key=step_of)


def read_meta(path: Path):
    """A checkpoint's meta.json as a `checkpoint_meta.CheckpointMeta`; a missing or unreadable
    one is a CheckpointError naming it."""
    from megatron_iiet.training.checkpoint_meta import parse_meta

    meta_file = Path(path) / META
    try:
        raw = meta_file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{meta_file}: missing (not a complete checkpoint)") from None
    return parse_meta(raw, meta_file)


def manifest(directory: Path) -> dict[str, int]:
    """{relative path: size} of every file under ``directory`` except meta.json."""
    directory = Path(directory)
    return {str(f.relative_to(directory)): f.stat().st_size
            for f in sorted(directory.rglob("*")) if f.is_file() and f.name != META}


def file_checksum(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_HASH_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files (of ``sizes``: {name: bytes}) that rank ``rank`` of ``world`` hashes: the ranks
    of a job split the reading, largest files first to the least loaded rank."""
    loads, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        loads[least] += sizes[name]
        if least == rank:
            mine.append(name)
    return mine


def checksums(directory: Path, names: list[str]) -> dict[str, str]:
    """{name: checksum} of ``names`` (paths relative to ``directory``)."""
    return {name: file_checksum(Path(directory) / name) for name in names}


def checksum_record(sums: dict[str, str]) -> dict:
    """What meta.json holds under CHECKSUMS_KEY."""
    return {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(sums.items()))}


def verify_checksums(path: Path, meta, rank: int = 0, world: int = 1) -> Optional[str]:
    """Why a file of rank ``rank``'s share no longer has the checksum recorded at commit (one
    line naming it), or None. Checkpoints without checksums pass."""
    record = meta.checksums
    if not record:
        return None
    if record.get("algorithm") != CHECKSUM_ALGORITHM:
        return (f"{Path(path) / META}: checksums of an unknown kind "
                f"{record.get('algorithm')!r} (this version writes {CHECKSUM_ALGORITHM})")
    recorded, sizes = record.get("files", {}), meta.files
    for name in share({n: sizes.get(n, 0) for n in recorded}, rank, world):
        f = Path(path) / name
        try:
            actual = file_checksum(f)
        except OSError as err:
            return f"{f}: unreadable ({os.strerror(err.errno) if err.errno else err})"
        if actual != recorded[name]:
            return (f"{f}: altered since it was saved (its {CHECKSUM_ALGORITHM} checksum is "
                    f"{actual}, {recorded[name]} at commit); set checkpoint.load to an "
                    "earlier iter_* directory")
    return None


def defect(path: Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be loaded, or None when it is complete."""
    try:
        meta = read_meta(path)
    except CheckpointError as err:
        return str(err)
    for name, size in meta.files.items():
        f = Path(path) / name
        if not f.is_file():
            return f"{f}: missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{f}: truncated or altered ({actual} bytes, {size} when saved)"
    return None


def checkpoint_name_in(raw: bytes) -> Optional[str]:
    """The checkpoint name the bytes of a `latest` file hold (one bare iter_* name), else None."""
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return name if _ITER.fullmatch(name) else None


def describe_contents(raw: bytes, limit: int = 40) -> str:
    """A small file's contents for a one-line message: the text quoted (control characters
    escaped, cut at `limit`), "an empty file", or "N bytes of binary data"."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return f"{len(raw)} bytes of binary data"
    if not text:
        return "an empty file"
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def read_latest(root: Path) -> tuple[Optional[str], Optional[str]]:
    """(name in `latest`, problem): the name when the pointer reads as a checkpoint name."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None, f"{pointer}: missing"
    try:
        raw = pointer.read_bytes()
        raw.decode("utf-8")  # binary data is not a name gone wrong: the file is unreadable
    except (OSError, UnicodeDecodeError):
        return None, f"{pointer}: unreadable (not a checkpoint name)"
    name = checkpoint_name_in(raw)
    if name is None:
        return None, f"{pointer}: not a checkpoint name (found {describe_contents(raw)})"
    return name, None


def newest_complete(root: Path, warn: Callable[[str], None] = print) -> Optional[Path]:
    """The complete checkpoint with the highest step, warning about each broken newer one.

    `latest` is written last at every commit, so it normally names exactly this checkpoint; when
    it is missing, unreadable or names something else, the directory listing decides and the
    warning says so.
    """
    root = Path(root)
    chosen = None
    for path in reversed(list_checkpoints(root)):
        problem = defect(path)
        if problem is None:
            chosen = path
            break
        warn(f"warning: skipping broken checkpoint {path.name}: {problem}")
    if chosen is None:
        return None
    name, problem = read_latest(root)
    if problem is not None:
        warn(f"warning: {problem}; resuming from the newest complete checkpoint {chosen.name}")
    elif name != chosen.name:
        warn(f"warning: {root / LATEST} names {name}, but the newest complete checkpoint is "
             f"{chosen.name}; resuming from {chosen.name}")
    return chosen


def resolve_checkpoint(path: str | Path, follow_latest: bool = False) -> Path:
    """The checkpoint a user named: an `iter_*` directory, or a root: its newest complete
    checkpoint, or with ``follow_latest`` the one its `latest` names (a conversion of "the
    latest" must not guess: a garbled pointer is refused by name, not replaced by the listing;
    what the pointer names is checked when it is loaded). Anything else is a CheckpointError
    naming the file at fault."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: does not exist")
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory (expected a megatron checkpoint directory)")
    if (p / META).is_file() and follow_latest:
        return p
    if step_of(p) is not None or (p / META).exists():
        problem = defect(p)
        if problem is not None:
            raise CheckpointError(f"checkpoint {p}: {problem}")
        return p
    if follow_latest:
        pointer = p / LATEST
        if pointer.is_file():
            return _pointed_to(pointer)
        raise CheckpointError(f"{p}: not a megatron checkpoint (no {META}, no {LATEST} pointer); "
                              "pass a checkpoint root or one of its iter_* directories")
    found = newest_complete(p)
    if found is not None:
        return found
    raise CheckpointError(f"{path}: not a checkpoint (no {META}, no complete iter_* directory)")


def _pointed_to(pointer: Path) -> Path:
    try:
        raw = pointer.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{pointer}: unreadable ({err.strerror})") from err
    name = checkpoint_name_in(raw)
    if name is None:
        raise CheckpointError(f"{pointer}: not a checkpoint pointer (expected the name of an "
                              f"iter_* directory next to it, found {describe_contents(raw)})")
    target = pointer.parent / name
    if not (target / META).is_file():
        raise CheckpointError(f"{pointer}: points to {target}, which is not a complete checkpoint")
    return target


@dataclass
class ResumeCheck:
    """What a start would overwrite: complete checkpoints newer than the step it starts at."""

    newer: list[Path]

    def message(self, root: Path, start_step: int) -> str:
        names = ", ".join(p.name for p in self.newer)
        return (f"checkpoint.dir {root} holds checkpoints of a run past step {start_step}, where "
                f"this run starts ({names}); resume them (checkpoint.load=auto), choose another "
                "checkpoint.dir, or set checkpoint.overwrite=true to replace them (deleted once "
                "this run commits its first checkpoint)")


def newer_than(root: Path, step: int) -> ResumeCheck:
    return ResumeCheck([p for p in list_checkpoints(root) if step_of(p) > step
                        and defect(p) is None])
