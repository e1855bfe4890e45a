"""Verify a dataset's recorded sha256 once, not at every training start.

A successful check of `PREFIX.bin/.idx` against `PREFIX.meta.json` is remembered in
`PREFIX.verified.json`, keyed by the identity of the three files (real path, device, inode, size,
mtime in ns). While they stay the same, the check is trusted and nothing is read; any rewrite,
replacement or in-place edit changes the mtime and the check runs again. The token id range found
in the same pass is remembered with it.

Two cases are not remembered: files modified less than `SETTLE_SECONDS` ago (an edit within the
same timestamp tick as the last write would leave the mtime unchanged, so it could go unseen), and
datasets whose directory cannot be written (shared, read-only data): those are checked each time.
"""

from __future__ import annotations

import json
import os
import time

from megatron_iiet.data import indexed_io
from megatron_iiet.data.atomic import write_json_atomic
from megatron_iiet.data.indexed_io import TokenRange

CACHE_FORMAT = "megatron-iiet-verified/1"
SETTLE_SECONDS = 2.0


def _identity(prefix: str) -> dict:
    identity = {}
    for name, path in (("bin", indexed_io.bin_path(prefix)), ("idx", indexed_io.idx_path(prefix)),
                       ("meta", indexed_io.meta_path(prefix))):
        stat = os.stat(path)
        identity[name] = [os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns]
    return identity


def _remembered(prefix: str, identity: dict) -> TokenRange | None:
    try:
        cached = json.loads(indexed_io.verified_path(prefix).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # none yet, or unreadable: verify again
    if not isinstance(cached, dict) or cached.get("format") != CACHE_FORMAT or cached.get("files") != identity:
        return None
    return TokenRange(*cached["token_ids"])


def _settled(identity: dict) -> bool:
    newest = max(entry[4] for entry in identity.values())
    return newest < time.time_ns() - SETTLE_SECONDS * 1e9


def verify_checksums_once(prefix: str | os.PathLike) -> TokenRange:
    """Check `prefix`'s files against their recorded sha256 unless an earlier check of the very
    same files succeeded; returns the token id range. Raises CorruptDatasetError naming the file."""
    prefix = str(prefix)
    identity = _identity(prefix)
    remembered = _remembered(prefix, identity)
    if remembered is not None:
        return remembered
    token_ids = indexed_io.check_checksums_and_token_ids(prefix)
    if _identity(prefix) == identity and _settled(identity):  # unchanged while it was read
        record = {"format": CACHE_FORMAT, "files": identity, "token_ids": [token_ids.low, token_ids.high]}
        try:
            write_json_atomic(indexed_io.verified_path(prefix), record)
        except OSError:
            pass  # read-only or full data directory: verify again next time rather than fail
    return token_ids
