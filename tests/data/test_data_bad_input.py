"""Bad input: each case gives a clear error naming the file (and line), and leaves no output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.helpers import REPO, preprocess, write_jsonl
from megatron_iiet.data import indexed_io
from megatron_iiet.data.blend import validate_blend
from megatron_iiet.data.errors import CorruptDatasetError, DataInputError, TokenizerMismatchError


def _run(tmp_path, tokenizer, inputs, **overrides):
    return preprocess(inputs, tokenizer, overrides.pop("output_prefix", tmp_path / "out" / "ds"), **overrides)


def _no_output(tmp_path) -> bool:
    out = tmp_path / "out"
    return not out.exists() or not any(out.iterdir())


def test_invalid_utf8_names_file_and_line(tmp_path, small_tokenizer):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "ok"}\n{"text": "ok too"}\n{"text": "bad \xff byte"}\n')
    with pytest.raises(DataInputError, match=r"in\.jsonl: line 3: invalid UTF-8"):
        _run(tmp_path, small_tokenizer, [source])
    assert _no_output(tmp_path)
    text = tmp_path / "in.txt"
    text.write_bytes(b"line one\nline \xc3\x28 two\n")
    with pytest.raises(DataInputError, match=r"in\.txt: line 2: invalid UTF-8"):
        _run(tmp_path, small_tokenizer, [text], text_unit="line")


# jsonl lines are parsed in the worker processes: their errors still name file and line. A lone
# surrogate (`\ud800`) is valid UTF-8 and valid JSON, but not encodable text.
BAD_JSONL_RECORDS = {
    "missing text key": ('{"text": "fine"}\n\n{"body": "no text field"}\n', r"line 3: no field 'text' \(fields: body\)"),
    "lone surrogate": ('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n',
                       r"line 2: text is not valid Unicode \(surrogates not allowed"),
}


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("case", sorted(BAD_JSONL_RECORDS))
def test_bad_jsonl_record_names_file_and_line(tmp_path, small_tokenizer, case, workers):
    content, message = BAD_JSONL_RECORDS[case]
    source = tmp_path / "in.jsonl"
    source.write_text(content, encoding="utf-8")
    with pytest.raises(DataInputError, match=r"in\.jsonl: " + message):
        _run(tmp_path, small_tokenizer, [source], workers=workers)
    assert _no_output(tmp_path)


def test_invalid_json_names_line(tmp_path, small_tokenizer):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataInputError, match=r"in\.jsonl: line 2: invalid JSON"):
        _run(tmp_path, small_tokenizer, [source])


def test_empty_file_and_missing_path(tmp_path, small_tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataInputError, match=r"empty\.jsonl: file is empty"):
        _run(tmp_path, small_tokenizer, [empty])
    with pytest.raises(DataInputError, match=r"nothere\.jsonl: no such file or directory"):
        _run(tmp_path, small_tokenizer, [tmp_path / "nothere.jsonl"])
    with pytest.raises(DataInputError, match=r"pattern matches no files"):
        _run(tmp_path, small_tokenizer, [tmp_path / "*.parquet"])
    assert _no_output(tmp_path)


def test_bad_row_midway_leaves_no_partial_output(tmp_path, small_tokenizer):
    good = write_jsonl(tmp_path / "a.jsonl", [f"document {i}" for i in range(300)])
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 7}\n', encoding="utf-8")
    with pytest.raises(DataInputError, match=r"b\.jsonl: line 2: field 'text' holds int"):
        _run(tmp_path, small_tokenizer, [good, bad], batch_documents=16)
    assert _no_output(tmp_path)


def test_vocab_does_not_fit_dtype(tmp_path, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", ["x"])
    with pytest.raises(TokenizerMismatchError, match=r"tokenizer\.model: vocabulary of 600 tokens does not fit dtype uint8"):
        _run(tmp_path, small_tokenizer, [source], dtype="uint8")
    assert _no_output(tmp_path)


def test_negative_settings_are_refused(tmp_path, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", ["x"])
    with pytest.raises(DataInputError, match="--segment-cache-entries must be >= 0"):
        _run(tmp_path, small_tokenizer, [source], segment_cache_entries=-1)
    with pytest.raises(DataInputError, match="--shard-size must be positive"):
        _run(tmp_path, small_tokenizer, [source], shard_size=0)
    assert _no_output(tmp_path)


def test_output_directory_with_another_tokenizers_data(tmp_path, small_tokenizer):
    from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    other = tmp_path / "other_tok"
    train_tokenizer(TokenizerTrainingConfig(inputs=("builtin:python-stdlib:200KB",), output_dir=str(other), vocab_size=400))
    source = write_jsonl(tmp_path / "in.jsonl", ["some text", "more text"])
    _run(tmp_path, other / "tokenizer.model", [source], output_prefix=str(tmp_path / "out" / "first"))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(TokenizerMismatchError, match=r"first\.meta\.json: output directory .* another tokenizer"):
        _run(tmp_path, small_tokenizer, [source], output_prefix=str(tmp_path / "out" / "second"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    # Same tokenizer, same prefix, other arguments: refused unless --overwrite.
    with pytest.raises(DataInputError, match=r"different arguments \(differs in: text_unit\)"):
        _run(tmp_path, other / "tokenizer.model", [source], output_prefix=str(tmp_path / "out" / "first"), text_unit="line")


@pytest.fixture()
def dataset(tmp_path, small_tokenizer) -> str:
    source = write_jsonl(tmp_path / "in.jsonl", [f"document number {i} " * 5 for i in range(50)])
    return _run(tmp_path, small_tokenizer, [source], output_prefix=str(tmp_path / "ds" / "data")).outputs[0]


def test_truncated_and_corrupted_files_are_detected(tmp_path, dataset):
    indexed_io.verify_dataset(dataset, check_checksums=True)
    original_bin, original_idx = (Path(dataset + s).read_bytes() for s in (".bin", ".idx"))
    Path(dataset + ".bin").write_bytes(original_bin[:-10])
    with pytest.raises(CorruptDatasetError, match=r"data\.bin: truncated or corrupted"):
        indexed_io.verify_dataset(dataset)
    with pytest.raises(ValueError, match=r"data\.bin: truncated"):
        validate_blend(f"1.0 {dataset}")
    flipped = bytearray(original_bin)
    flipped[7] ^= 0xFF
    Path(dataset + ".bin").write_bytes(bytes(flipped))
    with pytest.raises(CorruptDatasetError, match=r"data\.bin: checksum differs"):
        indexed_io.verify_dataset(dataset, check_checksums=True)
    with pytest.raises(CorruptDatasetError, match=r"data\.bin: checksum differs"):
        indexed_io.merge_datasets([dataset], str(tmp_path / "merged"))
    assert not list(tmp_path.glob("merged*"))
    Path(dataset + ".bin").write_bytes(original_bin)
    Path(dataset + ".idx").write_bytes(original_idx[:-8])
    with pytest.raises(CorruptDatasetError, match=r"data\.idx: truncated or corrupted"):
        indexed_io.verify_dataset(dataset)
    Path(dataset + ".idx").write_bytes(b"garbage!" + original_idx[8:])
    with pytest.raises(CorruptDatasetError, match=r"data\.idx: not a megatron index"):
        indexed_io.verify_dataset(dataset)


def test_validate_blend(tmp_path, dataset, small_tokenizer):
    assert validate_blend(f"0.3 {dataset} 0.7 {dataset}") == [(0.3, dataset), (0.7, dataset)]
    assert validate_blend([dataset]) == [(1.0, dataset)]
    with pytest.raises(ValueError, match="must be positive"):
        validate_blend(f"0 {dataset}")
    with pytest.raises(ValueError, match="is not a number"):
        validate_blend(f"abc {dataset} 1 {dataset}")
    with pytest.raises(ValueError, match="expected WEIGHT PREFIX pairs"):
        validate_blend(f"1 {dataset} 2")
    with pytest.raises(ValueError, match=r"nope: missing .*nope\.bin"):
        validate_blend(f"1 {dataset} 1 {tmp_path / 'nope'}")
    with pytest.raises(ValueError, match="was made with tokenizer"):
        validate_blend(f"1 {dataset}", expected_fingerprint="vocab-sha256:another")
    meta = indexed_io.read_meta(dataset)
    meta["tokenizer"]["fingerprint"] = "vocab-sha256:different"
    copy = tmp_path / "copy"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"copy{suffix}").write_bytes(Path(dataset + suffix).read_bytes())
    indexed_io.write_json_atomic(indexed_io.meta_path(copy), meta)
    with pytest.raises(ValueError, match=r"copy was made with tokenizer vocab-sha256:different"):
        validate_blend(f"1 {dataset} 1 {copy}")


def test_cli_exits_nonzero_with_one_line_reason(tmp_path, small_tokenizer):
    script = str(REPO / "tools" / "preprocess_data.py")
    assert subprocess.run([sys.executable, script, "--help"], capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([sys.executable, script, "--input", str(tmp_path / "missing.jsonl"), "--tokenizer",
                             str(small_tokenizer), "--output-prefix", str(tmp_path / "o" / "ds")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.jsonl'}: no such file or directory"]
    assert not (tmp_path / "o").exists()
