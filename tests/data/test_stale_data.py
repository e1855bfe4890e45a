"""Data that changed under a remembered check (issue 28, items 10 and 11): megatron's sample-index
cache and the remembered checksum verification must follow the bytes, not the file names."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from megatron_iiet.data import checksum_cache, indexed_io
from megatron_iiet.data.blend import validate_blend
from megatron_iiet.data.tokenizer import Tokenizer
from tests.data.helpers import preprocess, write_jsonl

HOUR_NS = 3600 * 10**9


def _age(prefix) -> None:
    """Date the files back: just-written files are not remembered (same-tick edits)."""
    for path in indexed_io.dataset_files(prefix):
        stamp = path.stat().st_mtime_ns - HOUR_NS
        os.utime(path, ns=(stamp, stamp))


def _overwrite_keeping_mtime(path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place, same size, and put the mtime back (what `os.utime`, `touch -d`
    or `cp -p` onto the file leave): only the ctime tells."""
    stamp = path.stat().st_mtime_ns
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)
    os.utime(path, ns=(stamp, stamp))


def _as_if_ctime_unchanged(prefix) -> None:
    """Rewrite the remembered identity to the files' current one: what a file system that keeps
    no faithful ctime (some network and FUSE mounts) would show after the edit. The record is the
    only thing forged; the files and the check are real."""
    path = indexed_io.verified_path(prefix)
    record = json.loads(path.read_text())
    record["files"] = checksum_cache._identity(str(prefix))
    path.write_text(json.dumps(record))


@pytest.fixture()
def big_dataset(tmp_path, small_tokenizer) -> str:
    """20 MiB of random tokens (20 blocks of the sampled check), verified and remembered."""
    tokenizer = Tokenizer.from_path(small_tokenizer)
    prefix = str(tmp_path / "big" / "data")
    tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, 10 * 2**20, dtype=np.uint16)
    writer = indexed_io.IndexedDatasetWriter(prefix, np.uint16)
    writer.add_documents(tokens, np.full(tokens.size // 1024, 1024))
    writer.finalize({"tokenizer": tokenizer.describe()})
    _age(prefix)
    assert validate_blend(prefix) == [(1.0, prefix)]
    assert indexed_io.verified_path(prefix).exists()
    return prefix


CORRUPT = re.escape("checksum differs from data.meta.json; the file is corrupted")


def test_same_size_overwrite_with_the_mtime_put_back_is_caught(big_dataset):
    # issue 28: 58% of the .bin overwritten, same size and mtime, trained silently
    binary = indexed_io.bin_path(big_dataset)
    _overwrite_keeping_mtime(binary, 0, os.urandom(int(binary.stat().st_size * 0.58)))
    with pytest.raises(ValueError, match=f"data.bin: {CORRUPT}"):
        validate_blend(big_dataset)


def test_sampled_blocks_catch_an_overwrite_the_file_times_miss(big_dataset):
    binary = indexed_io.bin_path(big_dataset)
    _overwrite_keeping_mtime(binary, 0, os.urandom(int(binary.stat().st_size * 0.58)))
    _as_if_ctime_unchanged(big_dataset)
    # 8 of the 20 blocks re-read: all 8 among the 8 untouched ones has odds 1 in 125970
    with pytest.raises(ValueError, match=f"data.bin: {CORRUPT}"):
        validate_blend(big_dataset)


def test_full_mode_catches_a_single_changed_byte(big_dataset):
    binary = indexed_io.bin_path(big_dataset)
    original = binary.read_bytes()[5 * 2**20 + 3]
    _overwrite_keeping_mtime(binary, 5 * 2**20 + 3, bytes([original ^ 1]))
    _as_if_ctime_unchanged(big_dataset)
    with pytest.raises(ValueError, match=f"data.bin: {CORRUPT}"):
        validate_blend(big_dataset, verify_checksums="full")


def test_verify_checksums_values(tmp_path):
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training.config import load_config

    assert load_config(None, ["data.verify_checksums=full"]).data.verify_checksums == "full"
    assert load_config(None, ["data.verify_checksums=false"]).data.verify_checksums is False
    with pytest.raises(BadInput, match=r"^data\.verify_checksums: unknown 'fast' \(true \| false \| full\)$"):
        load_config(None, ["data.verify_checksums=fast"])


# ---- item 10: megatron's index cache -----------------------------------------------------------
def _samples(prefix, tokenizer, cache_dir, log_dir) -> list[list[int]]:
    from megatron_iiet.training.config import TrainConfig
    from megatron_iiet.training.data import build_datasets, resolve_sources

    cfg = TrainConfig()
    cfg.data.train, cfg.data.tokenizer = str(prefix), str(tokenizer)
    cfg.data.seq_length, cfg.data.split, cfg.data.cache_dir = 16, "80,20,0", str(cache_dir)
    cfg.schedule.train_steps, cfg.parallel.global_batch_size = 20, 8
    cfg.logging.dir = str(log_dir)
    train, _ = build_datasets(cfg, resolve_sources(cfg))
    return [train[i]["tokens"].tolist() for i in range(len(train))]


def test_data_preprocessed_again_into_the_same_prefix_gets_new_indices(tmp_path, small_tokenizer):
    prefix = tmp_path / "ds" / "data"
    cache = tmp_path / "shared_cache"  # one folder for every run, as in a sweep
    old = write_jsonl(tmp_path / "old.jsonl", [f"the old text number {i} " * (3 + i % 7) for i in range(60)])
    preprocess([old], small_tokenizer, prefix)
    before = _samples(prefix, small_tokenizer, cache, tmp_path / "run1")
    # other text, as many documents, other lengths: megatron's key (path, seed, sizes) is unchanged
    new = write_jsonl(tmp_path / "new.jsonl", [f"completely different words {i} " * (9 - i % 5) for i in range(60)])
    preprocess([new], small_tokenizer, prefix, overwrite=True)
    after = _samples(prefix, small_tokenizer, cache, tmp_path / "run2")
    truth = _samples(prefix, small_tokenizer, tmp_path / "fresh_cache", tmp_path / "run3")
    assert after == truth
    assert after != before
