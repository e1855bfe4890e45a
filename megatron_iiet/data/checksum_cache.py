"""Verify a dataset's recorded sha256 once, not at every training start.

A successful check of `PREFIX.bin/.idx` against `PREFIX.meta.json` is remembered in
`PREFIX.verified.json`, keyed by the identity of the three files (real path, device, inode, size,
mtime and ctime in ns) and the meta.json's own sha256. While they stay the same, the full read is
skipped; the token id range found in the same pass is remembered with it.

The identity is not proof: a same-size overwrite with the mtime put back (`os.utime`, `touch -d`,
`cp -p` onto the file) keeps the mtime, so the ctime is part of it too (no ordinary tool can set
a ctime back). Where a file system does not keep ctimes faithfully, a second line catches the
edit: the full read also records a crc32 per 1 MiB block of each file, and every start re-reads
`SAMPLED_BLOCKS` random blocks of each against them (a few ms; docs/benchmarks.md). A mismatch
means the full check runs again, and it names the file. `data.verify_checksums=full` skips the
remembered check and reads everything (a single changed byte is found only that way).

Two cases are not remembered: files modified less than `SETTLE_SECONDS` ago (an edit within the
same timestamp tick as the last write would leave the mtime unchanged, so it could go unseen), and
datasets whose directory cannot be written (shared, read-only data): those are checked each time.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import time
import zlib

import numpy as np

from megatron_iiet.data import indexed_io
from megatron_iiet.data.atomic import write_json_atomic
from megatron_iiet.data.indexed_io import TokenRange

CACHE_FORMAT = "megatron-iiet-verified/2"
SETTLE_SECONDS = 2.0
SAMPLED_BLOCKS = 8
"""Blocks of each file re-read at every start: an edit touching a fraction f of the blocks goes
unseen by one start with probability (1 - f) ** 8 (0.1% for the 58% overwrite of issue 28)."""

_FILES = (("bin", indexed_io.bin_path), ("idx", indexed_io.idx_path))


def _identity(prefix: str) -> dict:
    identity = {}
    for name, path in (*_FILES, ("meta", indexed_io.meta_path)):
        path = path(prefix)
        stat = os.stat(path)
        identity[name] = [os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                          stat.st_ctime_ns]
    return identity


def _meta_sha256(prefix: str) -> str:
    return hashlib.sha256(indexed_io.meta_path(prefix).read_bytes()).hexdigest()


def _pack(sums: list[int]) -> str:
    return base64.b64encode(np.asarray(sums, dtype="<u4").tobytes()).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype="<u4")


def _remembered(prefix: str, identity: dict) -> dict | None:
    try:
        cached = json.loads(indexed_io.verified_path(prefix).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # none yet, or unreadable: verify again
    if not isinstance(cached, dict) or cached.get("format") != CACHE_FORMAT or cached.get("files") != identity:
        return None
    if cached.get("meta_sha256") != _meta_sha256(prefix):
        return None
    return cached


def _sampled_blocks_match(prefix: str, record: dict, identity: dict) -> bool:
    """Re-read a few random blocks of each file against the crc32s of the full read."""
    pick = random.SystemRandom()  # not the seeded global generator: each start samples anew
    try:
        for name, path in _FILES:
            sums = _unpack(record["blocks"][name])
            size = identity[name][3]
            if len(sums) != -(-size // indexed_io.BLOCK_BYTES):
                return False
            with open(path(prefix), "rb") as handle:
                for block in pick.sample(range(len(sums)), min(SAMPLED_BLOCKS, len(sums))):
                    handle.seek(block * indexed_io.BLOCK_BYTES)
                    if zlib.crc32(handle.read(indexed_io.BLOCK_BYTES)) != int(sums[block]):
                        return False
    except (KeyError, TypeError, ValueError):
        return False  # a record without (readable) block sums: verify in full
    return True


def _settled(identity: dict) -> bool:
    newest = max(entry[4] for entry in identity.values())
    return newest < time.time_ns() - SETTLE_SECONDS * 1e9


def verify_checksums_once(prefix: str | os.PathLike, full: bool = False) -> TokenRange:
    """Check `prefix`'s files against their recorded sha256 unless an earlier check of the very
    same files succeeded (and a sample of their blocks still matches it); `full`: read everything
    whatever is remembered. Returns the token id range. Raises CorruptDatasetError naming the
    file."""
    prefix = str(prefix)
    identity = _identity(prefix)
    remembered = None if full else _remembered(prefix, identity)
    if remembered is not None and _sampled_blocks_match(prefix, remembered, identity):
        return TokenRange(*remembered["token_ids"])
    blocks: dict = {}
    token_ids = indexed_io.check_checksums_and_token_ids(prefix, blocks)
    if _identity(prefix) == identity and _settled(identity):  # unchanged while it was read
        record = {"format": CACHE_FORMAT, "files": identity, "meta_sha256": _meta_sha256(prefix),
                  "token_ids": [token_ids.low, token_ids.high],
                  "blocks": {name: _pack(sums) for name, sums in blocks.items()}}
        try:
            write_json_atomic(indexed_io.verified_path(prefix), record)
        except OSError:
            pass  # read-only or full data directory: verify again next time rather than fail
    return token_ids
