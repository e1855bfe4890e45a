"""Tokenizer training, the Tokenizer wrapper, and HF files that encode like the sentencepiece model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import REPO, gutenberg_paragraphs
from megatron_iiet.data.errors import TokenizerMismatchError
from megatron_iiet.data.tokenizer import Tokenizer, check_dtype_fits, smallest_token_dtype
from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

EDGE_CASES = [
    "",
    " leading space",
    "trailing spaces   ",
    "  two leading, \t tab, \r\n CRLF and \n\n\n blank lines",
    "    def indented(code):\n        return {'x': [1, 2, 3]}\n",
    "byte fallback: 日本語, Ελληνικά, emoji 🙂, combining é",
    "digits 1234567890 and 3.14159",
    "literal specials </s> <s> <pad> <unk> stay text",
]


def _real_texts(shared) -> list[str]:
    texts = gutenberg_paragraphs(shared, books=22)[::20]
    wiki = (shared / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8").split("\n")
    shakespeare = (shared / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n\n")
    return EDGE_CASES + texts + wiki[::6] + shakespeare[::10]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    """BPE and unigram tokenizers trained on two Gutenberg books written as jsonl."""
    from tests.data.helpers import write_jsonl

    root = tmp_path_factory.mktemp("hf")
    corpus = write_jsonl(root / "train.jsonl", gutenberg_paragraphs(shared_data, books=1))
    made = {}
    for model_type in ("bpe", "unigram"):
        out = root / model_type
        train_tokenizer(TokenizerTrainingConfig(inputs=(str(corpus),), output_dir=str(out), vocab_size=800,
                                                model_type=model_type, input_sentence_size=20000))
        made[model_type] = out
    return made


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_hf_files_encode_like_sentencepiece(trained, shared_data, model_type):
    from transformers import AutoTokenizer

    directory = trained[model_type]
    sp = Tokenizer.from_path(directory / "tokenizer.model")
    auto = AutoTokenizer.from_pretrained(str(directory))  # offline: HF_HUB_OFFLINE=1 in conftest
    texts = _real_texts(shared_data)
    if model_type == "unigram":  # documented limitation: unigram vocab matches literal "</s>"
        texts = [t for t in texts if "</s>" not in t]
    expected = sp.encode_batch(texts)
    got = auto(texts)["input_ids"]
    mismatches = [i for i in range(len(texts)) if expected[i] != got[i]]
    if model_type == "unigram":
        # Documented limitation: on equal-score ties (runs of spaces covered by the same pieces
        # in another order) HF's Viterbi picks another order. Same pieces, same text, rare.
        assert all(sorted(expected[i]) == sorted(got[i]) for i in mismatches)
        assert len(mismatches) <= len(texts) // 200
        mismatches = []
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {texts[mismatches[0]][:80]!r}"
    for ids, other_ids, text in zip(expected, got, texts):
        assert auto.decode(ids) == sp.decode(ids) == sp.decode(other_ids) == text


def test_byte_fallback_is_exercised(trained):
    sp = Tokenizer.from_path(trained["bpe"] / "tokenizer.model")
    pieces = sp.pieces()
    ids = sp.encode("日本語 🙂")
    assert any(pieces[i].startswith("<0x") for i in ids)
    assert sp.decode(ids) == "日本語 🙂"


def test_wrapper_special_ids_and_fingerprint(trained):
    sp = Tokenizer.from_path(trained["bpe"] / "tokenizer.model")
    hf = Tokenizer.from_path(trained["bpe"])
    assert (sp.bos_id, sp.eos_id, sp.eod_id, sp.pad_id) == (1, 2, 2, 3)
    assert (hf.bos_id, hf.eos_id, hf.eod_id, hf.pad_id) == (1, 2, 2, 3)
    assert sp.vocab_size == hf.vocab_size == 800
    assert sp.fingerprint == hf.fingerprint
    other = Tokenizer.from_path(trained["unigram"] / "tokenizer.model")
    assert other.fingerprint != sp.fingerprint
    text = "It was the best of times,\r\nit was the worst of times."
    assert hf.encode(text) == sp.encode(text) and hf.decode(sp.encode(text)) == text


def test_autotokenizer_loads_in_a_fresh_offline_process(trained):
    code = (
        "from transformers import AutoTokenizer; import sys;"
        f"t = AutoTokenizer.from_pretrained({str(trained['bpe'])!r});"
        "print(t('Call me Ishmael.')['input_ids'])"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    sp = Tokenizer.from_path(trained["bpe"] / "tokenizer.model")
    assert out.stdout.strip() == str(sp.encode("Call me Ishmael."))


def test_user_defined_and_control_symbols(tmp_path):
    out = tmp_path / "tok"
    train_tokenizer(TokenizerTrainingConfig(inputs=("builtin:python-stdlib:300KB",), output_dir=str(out), vocab_size=500,
                                            user_defined_symbols=("<|code|>",), control_symbols=("<|sep|>",)))
    sp = Tokenizer.from_path(out / "tokenizer.model")
    hf = Tokenizer.from_path(out)
    pieces = sp.pieces()
    assert "<|code|>" in pieces and "<|sep|>" in pieces
    text = "x = 1 <|code|> y <|sep|> z"
    ids = sp.encode(text)
    assert pieces.index("<|code|>") in ids  # user-defined: kept whole
    assert pieces.index("<|sep|>") not in ids  # control: never produced from text
    assert hf.encode(text) == ids


def test_smallest_dtype_and_fit_check():
    assert smallest_token_dtype(256) is np.uint8
    assert smallest_token_dtype(257) is np.uint16
    assert smallest_token_dtype(65536) is np.uint16
    assert smallest_token_dtype(65537) is np.int32
    with pytest.raises(TokenizerMismatchError, match="does not fit dtype uint16"):
        check_dtype_fits(70000, np.uint16, "tok.model")


def test_train_tokenizer_cli_help_and_bad_input(tmp_path):
    script = str(REPO / "tools" / "train_tokenizer.py")
    assert subprocess.run([sys.executable, script, "--help"], capture_output=True, timeout=60).returncode == 0
    bad = subprocess.run([sys.executable, script, "--input", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "nope.jsonl: no such file or directory" in bad.stderr
    assert not (tmp_path / "o").exists()


def _reordered_merges(model: Path, out: Path) -> Path:
    """A copy of the BPE model at ``model`` with the same pieces in the same ids, but two merges
    ranked the other way round (their scores swapped)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    merged = [p for p in proto.pieces if p.type == 1 and len(p.piece) >= 2]
    first, last = merged[0], merged[-1]
    first.score, last.score = last.score, first.score
    out.write_bytes(proto.SerializeToString())
    return out


def test_fingerprint_tells_merge_orders_apart_and_still_accepts_the_legacy_one(
        small_tokenizer, tmp_path):
    from megatron_iiet.data import indexed_io
    from megatron_iiet.data.blend import validate_blend
    from megatron_iiet.data.tokenizer import fingerprint_matches
    from tests.data.helpers import preprocess, write_jsonl

    sp = Tokenizer.from_path(small_tokenizer)
    other = Tokenizer.from_path(_reordered_merges(small_tokenizer, tmp_path / "other.model"))
    assert other.pieces() == sp.pieces()
    assert other.legacy_fingerprint == sp.legacy_fingerprint  # what versions before recorded
    assert other.fingerprint != sp.fingerprint
    # a dataset of an earlier version records the legacy fingerprint: still this tokenizer's
    source = write_jsonl(tmp_path / "in.jsonl", [f"document {i} " * 5 for i in range(20)])
    dataset = preprocess([source], small_tokenizer, str(tmp_path / "ds" / "data")).outputs[0]
    meta = indexed_io.read_meta(dataset)
    assert meta["tokenizer"]["fingerprint"] == sp.fingerprint
    meta["tokenizer"]["fingerprint"] = sp.legacy_fingerprint
    indexed_io.write_json_atomic(indexed_io.meta_path(dataset), meta)
    assert validate_blend(dataset, expected_fingerprint=sp.fingerprint) == [(1.0, dataset)]
    assert fingerprint_matches(sp.legacy_fingerprint, sp.fingerprint)
    assert not fingerprint_matches(other.fingerprint, sp.fingerprint)
    meta["tokenizer"]["fingerprint"] = other.fingerprint
    indexed_io.write_json_atomic(indexed_io.meta_path(dataset), meta)
    with pytest.raises(ValueError, match=f"made with tokenizer {other.fingerprint}"):
        validate_blend(dataset, expected_fingerprint=sp.fingerprint)


def test_a_dataset_recorded_with_the_legacy_fingerprint_is_still_complete(small_tokenizer,
                                                                          tmp_path):
    """Data preprocessed before the fingerprint hashed the whole model (the quickstart's
    outputs/builtin_data on a machine that ran it before) is the same run, not a conflict."""
    import json

    from megatron_iiet.data.tokenizer import Tokenizer
    from tests.data.helpers import preprocess

    text = tmp_path / "a.txt"
    text.write_text("some text to tokenize\n" * 50)
    prefix = tmp_path / "data"
    assert not preprocess([text], small_tokenizer, prefix).already_complete
    meta_file = tmp_path / "data.meta.json"
    meta = json.loads(meta_file.read_text())
    legacy = Tokenizer.from_path(str(small_tokenizer)).legacy_fingerprint
    assert meta["run"]["tokenizer_fingerprint"] != legacy
    meta["run"]["tokenizer_fingerprint"] = legacy
    meta_file.write_text(json.dumps(meta))
    assert preprocess([text], small_tokenizer, prefix).already_complete
