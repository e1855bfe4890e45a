"""Preprocessing: round trip through megatron-core's reader, shards + merge, workers, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import REPO, gutenberg_paragraphs, megatron_documents as _documents, write_jsonl
from megatron_iiet.data import indexed_io
from megatron_iiet.data.preprocess import PreprocessConfig, run_preprocess, shard_prefix
from megatron_iiet.data.tokenizer import Tokenizer


def _bytes(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


@pytest.fixture(scope="module")
def texts(shared_data) -> list:
    paragraphs = gutenberg_paragraphs(shared_data, books=2, limit=1500)
    # Empty and null texts are counted and dropped; everything else must come back verbatim.
    return paragraphs[:10] + ["", None, "  spaced  \r\n  out  ", "日本語 🙂 é"] + paragraphs[10:]


def test_round_trip_through_megatron_reader(tmp_path, small_tokenizer, texts):
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    summary = run_preprocess(PreprocessConfig(inputs=(str(source),), tokenizer=str(small_tokenizer),
                                              output_prefix=str(tmp_path / "out" / "ds"), workers=0, progress=False))
    tokenizer = Tokenizer.from_path(small_tokenizer)
    kept = [t for t in texts if t]
    assert (summary.documents, summary.empty_documents, summary.skipped_documents) == (len(kept), 1, 1)
    documents = _documents(str(tmp_path / "out" / "ds"))
    assert len(documents) == len(kept)
    for text, tokens in zip(kept, documents):
        assert tokens.dtype == np.uint16  # vocab 600: the smallest dtype that fits
        assert tokens[-1] == tokenizer.eod_id and tokenizer.eod_id not in tokens[:-1]
        assert tokenizer.decode(tokens[:-1]) == text
    meta = indexed_io.read_meta(str(tmp_path / "out" / "ds"))
    assert meta["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert meta["tokens"] == sum(len(d) for d in documents)
    assert not [p for p in (tmp_path / "out").iterdir() if "tmp-partial" in p.name]


def test_shards_merge_and_workers_are_byte_identical(tmp_path, small_tokenizer, texts):
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    common = dict(inputs=(str(source),), tokenizer=str(small_tokenizer), progress=False, batch_documents=64)
    run_preprocess(PreprocessConfig(output_prefix=str(tmp_path / "single" / "ds"), workers=0, **common))
    sharded = run_preprocess(PreprocessConfig(output_prefix=str(tmp_path / "sharded" / "ds"), workers=2,
                                              shard_size=20_000, merge=True, keep_shards=True, **common))
    shards = sorted(p for p in (tmp_path / "sharded").glob("ds_shard*.bin"))
    assert len(shards) >= 5
    assert sharded.outputs == [str(tmp_path / "sharded" / "ds")]
    assert _bytes(str(tmp_path / "single" / "ds")) == _bytes(str(tmp_path / "sharded" / "ds"))
    # Each shard is a dataset of its own, and they hold the documents in order.
    from_shards = [d for s in shards for d in _documents(str(s)[:-4])]
    assert [d.tolist() for d in from_shards] == [d.tolist() for d in _documents(str(tmp_path / "single" / "ds"))]
    # A second identical run finds the finished output and does nothing.
    again = run_preprocess(PreprocessConfig(output_prefix=str(tmp_path / "sharded" / "ds"), workers=2,
                                            shard_size=20_000, merge=True, keep_shards=True, **common))
    assert again.already_complete


def test_resume_after_sigkill_gives_identical_bytes(tmp_path, small_tokenizer, shared_data):
    source = write_jsonl(tmp_path / "in.jsonl", gutenberg_paragraphs(shared_data, books=4))
    reference = tmp_path / "ref" / "ds"
    run_preprocess(PreprocessConfig(inputs=(str(source),), tokenizer=str(small_tokenizer), output_prefix=str(reference),
                                    workers=0, progress=False))
    prefix = tmp_path / "killed" / "ds"
    command = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(source), "--tokenizer",
               str(small_tokenizer), "--output-prefix", str(prefix), "--workers", "1", "--shard-size", "40K",
               "--merge", "--batch-documents", "32", "--no-progress"]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    # Kill once shard 3 is done and a later shard is being written (its temporary file exists): between
    # two shards there is a moment with no temporary file, and a kill there would test nothing.
    while not (indexed_io.meta_path(shard_prefix(str(prefix), 3)).exists()
               and list(prefix.parent.glob("*tmp-partial*"))):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.killpg(process.pid, signal.SIGKILL)  # the CLI and its worker, mid-shard
    process.wait()
    assert not indexed_io.meta_path(prefix).exists()
    assert list(prefix.parent.glob("*tmp-partial*")), "the kill should have caught a shard half-written"
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "shards resumed" in resumed.stdout
    resumed_count = int(resumed.stdout.split("shards resumed")[1].split()[0])
    assert resumed_count >= 4
    assert _bytes(str(prefix)) == _bytes(str(reference))
    assert not list(prefix.parent.glob("*tmp-partial*")) and not list(prefix.parent.glob("ds_shard*"))


def test_formats_directories_and_globs(tmp_path, small_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["first document\nwith two lines", "second, with ünïcode", "third"]
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", docs[:1], key="body")
    pq.write_table(pa.table({"body": docs[1:2], "other": [1]}), folder / "b.parquet")
    (folder / "c.csv").write_text("body,n\n" + f'"{docs[2]}",3\n', encoding="utf-8")
    (folder / "notes.md").write_text("ignored: not a data file type")
    tokenizer = Tokenizer.from_path(small_tokenizer)
    for inputs in ((str(folder),), (str(folder / "*.*[tvl]"),)):
        prefix = tmp_path / f"out{len(inputs[0])}" / "ds"
        run_preprocess(PreprocessConfig(inputs=inputs, tokenizer=str(small_tokenizer), output_prefix=str(prefix),
                                        text_key="body", workers=0, progress=False))
        assert [tokenizer.decode(d[:-1]) for d in _documents(str(prefix))] == docs
    text_file = tmp_path / "book.txt"
    text_file.write_text("para one\nstill one\n\npara two\n", encoding="utf-8")
    for unit, expected in (("document", ["para one\nstill one\n\npara two\n"]), ("line", ["para one\n", "still one\n", "\n", "para two\n"])):
        prefix = tmp_path / f"txt_{unit}" / "ds"
        run_preprocess(PreprocessConfig(inputs=(str(text_file),), tokenizer=str(small_tokenizer), output_prefix=str(prefix),
                                        text_unit=unit, workers=0, progress=False))
        assert [tokenizer.decode(d[:-1]) for d in _documents(str(prefix))] == expected


def test_builtin_corpus_and_prepare_is_idempotent(tmp_path):
    from megatron_iiet.data.corpus import builtin_corpus_files
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    files = builtin_corpus_files("builtin:python-stdlib:500KB")
    assert files == builtin_corpus_files("builtin:python-stdlib:500KB")  # stable order
    assert all("/test/" not in f.path for f in files) and sum(f.size for f in files) >= 500 * 1024
    started = time.perf_counter()
    first = prepare_builtin_corpus(str(tmp_path), vocab_size=500, corpus_size="500KB")
    first_seconds = time.perf_counter() - started
    stamp = Path(first.data_prefix + ".bin").stat().st_mtime_ns
    second = prepare_builtin_corpus(str(tmp_path), vocab_size=500, corpus_size="500KB")
    assert second == first and Path(first.data_prefix + ".bin").stat().st_mtime_ns == stamp
    tokenizer = Tokenizer.from_path(first.tokenizer_model)
    documents = _documents(first.data_prefix)
    assert len(documents) == first.documents == len(files)
    assert tokenizer.decode(documents[0][:-1]) == Path(files[0].path).read_text(encoding="utf-8")
    assert Tokenizer.from_path(first.tokenizer_dir).fingerprint == first.fingerprint
    assert first_seconds < 60
