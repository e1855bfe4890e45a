"""The two fast paths of preprocessing give exactly what the plain paths give: the memoised
sentencepiece encoder (`encode_to_arrays`) vs per-document `sp.encode`, and the direct
.jsonl/.txt reader vs HF datasets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.data.helpers import gutenberg_paragraphs
from megatron_iiet.data.corpus import builtin_corpus_files
from megatron_iiet.data.inputs import ReaderConfig, iter_documents, resolve_inputs
from megatron_iiet.data.tokenizer import Tokenizer

# Edge cases for the segmenting: leading/trailing/repeated spaces, a literal `▁`, line breaks
# next to spaces, characters outside the vocabulary (byte fallback), tabs.
EDGE_TEXTS = ["", " ", "  ", "   ", "a ", "a  ", " a", "  a", "a\n  b  ", "x \u2581 y", "\u2581\u2581a",
              "日本語 🙂 é  z", "\t  \t", " \r\n  \r\n", "end.\r\n\r\nThe  next", "a" * 200 + " " + "b" * 60]


def _plain(tokenizer, texts, eod):
    return [np.array(tokenizer.encode(t) + [eod], dtype=np.uint16) for t in texts]


@pytest.mark.parametrize("corpus", ["prose", "code"])
def test_segment_cache_encodes_like_sentencepiece(small_tokenizer, shared_data, corpus):
    tokenizer = Tokenizer.from_path(small_tokenizer)
    assert tokenizer.segment_cache("uint16") is not None, tokenizer.segment_cache_blocker
    if corpus == "prose":  # CRLF Gutenberg text, cut into chunks like the benchmark's documents
        body = "\r\n\r\n".join(gutenberg_paragraphs(shared_data, books=2))
        texts = [body[i:i + 4096] for i in range(0, min(len(body), 1 << 21), 4096)]
    else:  # indented code: runs of spaces everywhere
        texts = [open(f.path, encoding="utf-8").read() for f in builtin_corpus_files("builtin:python-stdlib:1MB")]
    texts = EDGE_TEXTS + texts + texts[:50]  # the repeat is served from the cache
    flat, lengths = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id)
    expected = _plain(tokenizer, texts, tokenizer.eod_id)
    assert lengths.tolist() == [len(e) for e in expected]
    assert np.array_equal(flat, np.concatenate(expected))
    plain_flat, plain_lengths = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id, cache_segments=False)
    assert np.array_equal(plain_flat, flat) and np.array_equal(plain_lengths, lengths)


def test_segment_cache_is_bounded_and_exact_when_full(small_tokenizer):
    tokenizer = Tokenizer.from_path(small_tokenizer)
    encoder = tokenizer.segment_cache("uint16")
    encoder.reset(40)  # full after the first batch
    texts = [open(f.path, encoding="utf-8").read() for f in builtin_corpus_files("builtin:python-stdlib:300KB")]
    for start in range(0, len(texts), 7):
        batch = texts[start:start + 7] + EDGE_TEXTS
        assert encoder.encode_batch(batch) == [np.array(tokenizer.encode(t), dtype=np.uint16).tobytes() for t in batch]
        assert len(encoder.table) <= 40
    assert len(encoder.table) == 40 and encoder.misses > 40


def test_segment_cache_matches_sentencepiece_on_random_texts(small_tokenizer):
    """Random texts over an alphabet of the awkward cases (spaces and their runs, a literal `▁`,
    CRLF, tabs, NUL, characters outside the vocabulary, multi-byte UTF-8), with a small table that
    fills up: every batch equals sentencepiece, the first time and from the table."""
    import random

    tokenizer = Tokenizer.from_path(small_tokenizer)
    encoder = tokenizer.segment_cache("uint16")
    encoder.reset(300)
    rng = random.Random(0)
    alphabet = list("abcdefghij ABC  ,.;'\"\r\n\t-") + ["\u2581", "é", "日", "本", "🙂", "\x00", "ß", "  ", "the ", " and", "ing"]
    for _ in range(200):
        texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(rng.randint(1, 20))]
        assert encoder.encode_batch(texts) == [np.array(tokenizer.encode(t), dtype=np.uint16).tobytes() for t in texts], texts
    assert len(encoder.table) == 300


def test_segment_cache_is_exact_when_pieces_span_spaces(tmp_path):
    """A model trained without splitting at whitespace has pieces like `e▁t`: the cut then falls
    only where no piece joins two characters, and the ids still equal sentencepiece's."""
    import sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the cat sat on the mat {i % 7}\n  of the  day\n" for i in range(400)), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "m"), model_type="bpe", vocab_size=300, byte_fallback=True,
        split_by_whitespace=False, normalization_rule_name="identity", add_dummy_prefix=False,
        remove_extra_whitespaces=False, minloglevel=2)
    tokenizer = Tokenizer.from_path(tmp_path / "m.model")
    spanning = [p for p in tokenizer.pieces() if p.strip("\u2581") and "\u2581" in p.strip("\u2581")]
    assert spanning, "the model should hold pieces across a space"
    encoder = tokenizer.segment_cache("uint16")
    assert encoder is not None, tokenizer.segment_cache_blocker
    texts = ["the cat sat on the mat 3\n  of the  day", "the mat\u2581the cat", "xyz the  cat"] + EDGE_TEXTS
    for _ in range(2):  # the second time from the table
        assert encoder.encode_batch(texts) == [np.array(tokenizer.encode(t), dtype=np.uint16).tobytes() for t in texts]


def test_segment_table_checks_its_protocol(small_tokenizer):
    encoder = Tokenizer.from_path(small_tokenizer).segment_cache("uint16")
    table = encoder.table
    with pytest.raises(ValueError, match="scan"):
        table.join(["a b"], [])  # no scan before
    missing = table.scan(["a b", "a"])
    with pytest.raises(ValueError, match="scan"):
        table.join(["a b"], [])  # not the scanned texts
    with pytest.raises(ValueError, match="fresh"):
        table.join(["a b", "a"], [])  # the missing segments' ids not given
    with pytest.raises(TypeError):
        table.scan([b"bytes"])
    with pytest.raises(TypeError):
        table.add(missing, [None] * len(missing))
    with pytest.raises(TypeError):
        table.add(missing, [])
    with pytest.raises(RuntimeError, match="__init__"):
        type(table).__new__(type(table)).scan(["a"])


def test_without_the_c_table_encoding_falls_back_to_sentencepiece(small_tokenizer, monkeypatch):
    """Where the C helper could not be compiled (no compiler at install), documents are encoded
    one by one, same ids. The missing module is simulated: a compiler cannot be taken away here."""
    import sys

    monkeypatch.setitem(sys.modules, "megatron_iiet.data._segment_table", None)
    tokenizer = Tokenizer.from_path(small_tokenizer)
    assert tokenizer.segment_cache("uint16") is None and "not built" in tokenizer.segment_cache_blocker
    texts = ["x = 1  y", "def f():\n    return  2\n"]
    flat, _ = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id)
    assert np.array_equal(flat, np.concatenate(_plain(tokenizer, texts, tokenizer.eod_id)))


def test_segment_cache_refuses_models_it_cannot_reproduce(tmp_path):
    from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    out = tmp_path / "tok"
    train_tokenizer(TokenizerTrainingConfig(inputs=("builtin:python-stdlib:200KB",), output_dir=str(out), vocab_size=400,
                                            user_defined_symbols=("<|code|>",)))
    tokenizer = Tokenizer.from_path(out / "tokenizer.model")
    assert tokenizer.segment_cache("uint16") is None and "user-defined" in tokenizer.segment_cache_blocker
    texts = ["x = 1 <|code|> y", "def f():\n    return  2\n"]
    flat, _ = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id)  # falls back, same ids
    assert np.array_equal(flat, np.concatenate(_plain(tokenizer, texts, tokenizer.eod_id)))


def _rows(paths, **config):
    files = resolve_inputs([str(p) for p in paths])
    return {hf: [(d.file_index, d.row, d.text) for d in iter_documents(files, ReaderConfig(hf_reader=hf, **config))]
            for hf in (False, True)}


def test_direct_reader_matches_hf_datasets(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    records = [{"text": "one"}, None, {"text": None, "n": 1}, {"text": ""}, {"text": "ünï\r\ncode  🙂"}, None, {"text": "last"}]
    jsonl.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in records), encoding="utf-8")
    rows = _rows([jsonl])
    assert rows[False] == rows[True] and [r[2] for r in rows[False]] == ["one", None, "", "ünï\r\ncode  🙂", "last"]
    resumed = [(d.row, d.text) for d in iter_documents(resolve_inputs([str(jsonl)]), ReaderConfig(), 0, 3)]
    assert resumed == [(3, "ünï\r\ncode  🙂"), (4, "last")]
    text = tmp_path / "b.txt"
    text.write_bytes(b"para one\r\nstill one\r\n\r\npara two\rold mac\n\n\n\nthree\n\n")
    for unit in ("document", "paragraph", "line"):
        rows = _rows([text], text_unit=unit)
        assert rows[False] == rows[True], unit
