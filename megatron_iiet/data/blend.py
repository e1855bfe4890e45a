"""Validation of `weight prefix weight prefix ...` blends before megatron-core's
BlendedMegatronDatasetBuilder reads them: every dataset exists and is intact (structure, and the
sha256 recorded at preprocessing, checked once per file version: checksum_cache), all were made
with one tokenizer (fingerprint in each `<prefix>.meta.json`), no token id lies outside the
vocabulary, and every weight is positive."""

from __future__ import annotations

import math
from typing import Sequence

from megatron_iiet.data import indexed_io
from megatron_iiet.data.checksum_cache import verify_checksums_once
from megatron_iiet.data.tokenizer import fingerprint_matches


def _parse(spec: str | Sequence) -> list[str]:
    if isinstance(spec, str):
        return spec.split()
    return [str(item) for item in spec]


def _check_token_ids(prefix: str, token_ids: indexed_io.TokenRange | None, vocab_size: int) -> None:
    if token_ids is None or token_ids.high is None:
        return  # no range known (made before it was recorded, checksums not verified), or no tokens
    if token_ids.high >= vocab_size or token_ids.low < 0:
        bad = token_ids.high if token_ids.high >= vocab_size else token_ids.low
        raise ValueError(f"blend dataset {prefix} holds token id {bad}, outside the tokenizer's vocabulary "
                         f"of {vocab_size} (ids 0..{vocab_size - 1}); preprocess it with this tokenizer")


def blend_pairs(spec: str | Sequence) -> list[tuple[str, str]]:
    """[(weight text, prefix), ...] of a blend, as training parses it (no file is read)."""
    items = _parse(spec)
    if not items:
        raise ValueError("empty blend: give 'PREFIX' or 'WEIGHT PREFIX WEIGHT PREFIX ...'")
    if len(items) == 1:
        return [("1", items[0])]
    if len(items) % 2:
        raise ValueError(f"blend has {len(items)} items; expected WEIGHT PREFIX pairs: {' '.join(items)}")
    return list(zip(items[0::2], items[1::2]))


def validate_blend(spec: str | Sequence, expected_fingerprint: str | None = None, verify_checksums: bool | str = True,
                   vocab_size: int | None = None) -> list[tuple[float, str]]:
    """Parse and check a blend; returns [(weight, prefix), ...].

    `spec` is a string or list: `"0.3 data/a 0.7 data/b"`, or a single prefix (weight 1).
    `verify_checksums` compares every file with the sha256 its meta.json records (a full read the
    first time, then remembered per file version and sampled; "full": a full read every time);
    `vocab_size` refuses token ids >= it, found in that read, or taken from the meta.json when
    checksums are not verified.
    Raises ValueError with a message naming the offending entry.
    """
    pairs = blend_pairs(spec)
    result: list[tuple[float, str]] = []
    fingerprint_source: tuple[str, str] | None = None
    if expected_fingerprint is not None:
        fingerprint_source = (expected_fingerprint, "the expected tokenizer")
    for weight_text, prefix in pairs:
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"blend weight {weight_text!r} (before {prefix}) is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"blend weight {weight_text} for {prefix} must be positive")
        missing = [str(p) for p in (indexed_io.bin_path(prefix), indexed_io.idx_path(prefix)) if not p.is_file()]
        if missing:
            raise ValueError(f"blend dataset {prefix}: missing {', '.join(missing)}")
        info = indexed_io.verify_dataset(prefix)
        if info.documents == 0:
            raise ValueError(f"blend dataset {prefix} holds no documents")
        meta = indexed_io.read_meta(prefix)
        fingerprint = meta["tokenizer"]["fingerprint"]
        if fingerprint_source is None:
            fingerprint_source = (fingerprint, prefix)
        elif not fingerprint_matches(fingerprint, fingerprint_source[0]):
            raise ValueError(
                f"blend dataset {prefix} was made with tokenizer {fingerprint}, but "
                f"{fingerprint_source[1]} uses {fingerprint_source[0]}"
            )
        token_ids = (verify_checksums_once(prefix, full=verify_checksums == "full") if verify_checksums
                     else indexed_io.TokenRange.from_meta(meta))
        if vocab_size is not None:
            _check_token_ids(prefix, token_ids, vocab_size)
        result.append((weight, prefix))
    return result
