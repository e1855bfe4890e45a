"""The preprocessing fast path (memoised segment encoding) for the sentencepiece BPE models users
bring: spm_train's defaults (nmt_nfkc, dummy prefix, whitespace collapsing, no byte fallback),
Llama-style (identity, dummy prefix, byte fallback, split digits, whitespace-only pieces) and the
project's own tokenizer. Byte-identical ids to per-document `sp.encode` on prose, code and random
Unicode; one line on stderr, once per run, exactly when the fast path is off.

(test_data_fast_paths.py covers the table itself: bounds, protocol errors, pieces across spaces.)
"""

from __future__ import annotations

import random
import re
import sys

import numpy as np
import pytest

from megatron_iiet.data.bpe_cache import cache_blocker
from megatron_iiet.data.corpus import builtin_corpus_files
from megatron_iiet.data.tokenizer import Tokenizer
from tests.data.helpers import gutenberg_paragraphs, megatron_documents, preprocess, write_jsonl

LLAMA_STYLE = dict(normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
                   byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True)

# Whitespace of every kind in every position, a literal `▁`, characters NFKC rewrites (full-width,
# ligature, circled digit, ideographic space, NBSP, combining marks), zero-width and control
# characters, and text outside the vocabulary (CJK, Greek, emoji) in runs and alone.
EDGE_TEXTS = ["", " ", "   ", "\t", "\n", "\r\n\r\n", " a", "a ", "  a  b   c  ", "a\u2581b \u2581\u2581 c", "\u2581",
              "日本語", " 日本語 ", "日 本", "日本語🙂Ελληνικά", "x日y", "🙂", "🙂🙂 🙂", "ｆｕｌｌ　ｗｉｄｔｈ ①② ﬁ",
              "e\u0301 Å A\u030a", "\u00a0nbsp\u00a0\u00a0", "\u200bzero\u200bwidth\ufeff", "\x00nul\x01\x7f\x1b[0m",
              "tabs\t\tand  spaces \t mixed", "1234567890 3.14159 1,000,000", "line\nbreaks\r\nand\rcr", "</s> <s> <unk>"]
ALPHABET = (list("abcdefghijklmnopqrstuvwxyz ABCXYZ  ,.;:!?'\"()[]{}<>=+-*/\\|_#@$%^&~`\r\n\t0123456789") +
            ["\u2581", "é", "ß", "ø", "ñ", "ç", "日", "本", "語", "中", "文", "한", "🙂", "👍🏽", "🇩🇪", "\x00", "\x01", "\x1f", "\x7f",
             "\x85", "\u00a0", "\u2028", "\u3000", "\u200b", "\ufeff", "\ufffd", "ｆ", "①", "ﬁ", "Å", "A\u030a", "Ж", "א", "ع",
             "  ", "    ", "\t\t", "the ", " and ", "ing", "tion", "def ", "self.", "return ", "    if x:\n"])
UNICODE_RANGES = [(0x20, 0x7F), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F), (0x2000, 0x206F),
                  (0x2190, 0x23FF), (0x3000, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0xFF00, 0xFFEF),
                  (0x1F300, 0x1F64F), (0x0, 0x1F)]


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.15:
                low, high = rng.choice(UNICODE_RANGES)
                parts.append(chr(rng.randrange(low, high)))
            else:
                parts.append(rng.choice(ALPHABET))
        texts.append("".join(parts))
    return texts


def _code_texts() -> list[str]:
    files = builtin_corpus_files("builtin:python-stdlib:300KB")
    texts = [open(f.path, encoding="utf-8").read() for f in files]
    # Indentation with tabs and runs of spaces, which the standard library hardly has.
    texts += ["def f(x):\n\tif x:\n\t\treturn  x  *  2\n\telse:\n\t    return None   \n\n\n",
              "    \n        \n\t\n  \t  \n", "int main() {\n\tprintf(\"%d\\n\", 42);\t// done\n}\n", " " * 100 + "x" + "\t" * 30]
    return texts


def _corpus_lines() -> str:
    """Training text: a slice of the standard library (code, comments and docstring prose)."""
    files = builtin_corpus_files("builtin:python-stdlib:400KB")
    return "".join(open(f.path, encoding="utf-8").read() for f in files)


def _train(tmp_path_factory, name: str, vocab_size: int = 1500, **options):
    import sentencepiece

    out = tmp_path_factory.mktemp(name)
    corpus = out / "corpus.txt"
    corpus.write_text(_corpus_lines(), encoding="utf-8")
    options.setdefault("model_type", "bpe")
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out / "m"), vocab_size=vocab_size,
                                             minloglevel=2, **options)
    return out / "m.model"


@pytest.fixture(scope="session")
def spm_defaults_model(tmp_path_factory):
    """BPE at spm_train's defaults: only the model type and vocabulary size given."""
    return _train(tmp_path_factory, "spm_defaults")


@pytest.fixture(scope="session")
def llama_style_model(tmp_path_factory):
    return _train(tmp_path_factory, "llama_style", **LLAMA_STYLE)


@pytest.fixture(params=["spm_defaults", "llama_style", "project"])
def model(request, small_tokenizer):
    if request.param == "project":
        return small_tokenizer
    return request.getfixturevalue(f"{request.param}_model")


def _expected(tokenizer, texts, dtype="uint16"):
    return [np.array(tokenizer.encode(t), dtype=dtype).tobytes() for t in texts]


def test_the_models_are_the_kinds_named(spm_defaults_model, llama_style_model, small_tokenizer):
    """The fixtures exercise what makes each kind hard: NFKC, collapsed spaces and one `<unk>` for a
    run of unknown characters (defaults); a dummy prefix, kept spaces, bytes (Llama-style)."""
    from megatron_iiet.data.bpe_cache import _model_proto

    defaults, llama = Tokenizer.from_path(spm_defaults_model), Tokenizer.from_path(llama_style_model)
    spec = _model_proto(defaults._sp)
    assert spec.normalizer_spec.name == "nmt_nfkc" and spec.normalizer_spec.add_dummy_prefix
    assert spec.normalizer_spec.remove_extra_whitespaces and not spec.trainer_spec.byte_fallback
    run = defaults.encode("日本語🙂")
    assert len(run) == 2 and run[1] == defaults.unk_id  # the dummy `▁`, then one <unk> for the run
    assert defaults.encode("a  b") == defaults.encode(" a b ") and defaults.encode("ｆ①") == defaults.encode("f1")
    spec = _model_proto(llama._sp)
    assert spec.normalizer_spec.add_dummy_prefix and not spec.normalizer_spec.remove_extra_whitespaces
    assert spec.trainer_spec.byte_fallback and spec.trainer_spec.split_digits
    assert not spec.normalizer_spec.precompiled_charsmap  # the identity
    assert llama.encode("a  b") != llama.encode("a b") and llama._sp.is_byte(llama.encode("日")[-1])
    assert llama._sp.id_to_piece(llama.encode("x")[0]).startswith("\u2581")
    for path in (spm_defaults_model, llama_style_model, small_tokenizer):
        tokenizer = Tokenizer.from_path(path)
        assert tokenizer.segment_cache_blocker is None and tokenizer.segment_cache("uint16") is not None


def test_runs_of_unknown_characters_stay_one_unk(spm_defaults_model):
    """Without byte fallback a run of characters outside the vocabulary is one `<unk>`: the cut
    never falls inside such a run, and a cut next to one (a known character on the other side)
    still gives sentencepiece's ids."""
    tokenizer = Tokenizer.from_path(spm_defaults_model)
    sp, unk = tokenizer._sp, tokenizer.unk_id
    assert sp.encode("日本語🙂").count(unk) == 1 and sp.encode("日 本").count(unk) == 2
    texts = ["日本語🙂", "x日本y", "日,本", "a日b本c語", "日本 語", " 日本語 ", "🙂🙂🙂" * 20, "ab" + "日" * 50 + "cd"]
    encoder = tokenizer.segment_cache("uint16")
    for _ in range(2):  # the second time from the table
        assert encoder.encode_batch(texts) == _expected(tokenizer, texts)


def test_prose_is_byte_identical(model, shared_data):
    tokenizer = Tokenizer.from_path(model)
    paragraphs = gutenberg_paragraphs(shared_data, books=2, limit=3000)
    rng = random.Random(1)
    texts, at = [], 0
    body = "\r\n\r\n".join(paragraphs)
    while at < len(body) and len(texts) < 300:  # documents of random lengths, cut anywhere
        size = rng.randint(1, 6000)
        texts.append(body[at:at + size])
        at += size
    texts += paragraphs[:200]
    flat, lengths = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id)
    plain_flat, plain_lengths = tokenizer.encode_to_arrays(texts, "uint16", tokenizer.eod_id, cache_segments=False)
    assert np.array_equal(lengths, plain_lengths) and np.array_equal(flat, plain_flat)


def test_code_is_byte_identical(model):
    tokenizer = Tokenizer.from_path(model)
    encoder = tokenizer.segment_cache("uint16")
    texts = _code_texts()
    expected = _expected(tokenizer, texts)
    assert encoder.encode_batch(texts) == expected
    again = encoder.table.scan(encoder._normalise(texts))  # what a second pass would send to sentencepiece
    assert all(len(segment) > encoder.MAX_KEY_CHARS for segment in again)  # only segments too long to keep
    assert encoder.encode_batch(texts) == expected


def test_random_unicode_and_edge_cases_are_byte_identical(model):
    tokenizer = Tokenizer.from_path(model)
    encoder = tokenizer.segment_cache("uint16")
    encoder.reset(2000)  # small: fills up, so later batches mix table hits and fresh segments
    texts = EDGE_TEXTS + _random_texts(seed=7, count=1500)
    for start in range(0, len(texts), 100):
        batch = texts[start:start + 100]
        assert encoder.encode_batch(batch) == _expected(tokenizer, batch), batch
    assert len(encoder.table) == 2000
    assert encoder.encode_batch(EDGE_TEXTS) == _expected(tokenizer, EDGE_TEXTS)


@pytest.mark.parametrize("options", [
    dict(treat_whitespace_as_suffix=True),
    dict(split_by_whitespace=False),
    dict(normalization_rule_name="nmt_nfkc_cf", byte_fallback=True, character_coverage=0.98),
    dict(normalization_rule_name="nfkc", remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True),
], ids=["whitespace-suffix", "no-split-by-whitespace", "nfkc-cf-byte-fallback", "nfkc-kept-spaces"])
def test_other_bpe_settings_are_exact_too(tmp_path_factory, options):
    tokenizer = Tokenizer.from_path(_train(tmp_path_factory, "variant", vocab_size=500, **options))
    encoder = tokenizer.segment_cache("uint16")
    assert encoder is not None, tokenizer.segment_cache_blocker
    texts = EDGE_TEXTS + _random_texts(seed=3, count=300) + _code_texts()[:20]
    for _ in range(2):
        assert encoder.encode_batch(texts) == _expected(tokenizer, texts)


# ---- saying when the fast path is off ---------------------------------------------------------------
OFF = re.compile(r"^preprocess: segment cache off for tokenizer (.+): (.+); encoding per document$")


def _off_lines(captured: str) -> list[str]:
    return [line for line in captured.splitlines() if line.startswith("preprocess: segment cache")]


@pytest.fixture(scope="session")
def unigram_model(tmp_path_factory):
    return _train(tmp_path_factory, "unigram", vocab_size=400, model_type="unigram")


@pytest.fixture(scope="session")
def user_symbols_model(tmp_path_factory):
    return _train(tmp_path_factory, "user_symbols", vocab_size=400, user_defined_symbols=["<|code|>"])


TEXTS = ["Some prose, then  code:\n\tx = 1  # ok\n", "日本語 and 🙂", "", "   ", "<|code|> marks"]


@pytest.mark.parametrize("kind", ["unigram", "user_symbols"])
def test_off_is_said_once_with_the_reason(tmp_path, capfd, request, kind):
    path = request.getfixturevalue(f"{kind}_model")
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS * 30)
    preprocess([source], path, tmp_path / "out" / "ds", workers=2, batch_documents=8)  # several batches, two workers
    lines = _off_lines(capfd.readouterr().err)
    assert len(lines) == 1, lines
    match = OFF.match(lines[0])
    assert match and match.group(1) == str(path)
    assert ("unigram" if kind == "unigram" else "user-defined symbols") in match.group(2)
    tokenizer = Tokenizer.from_path(path)
    expected = [tokenizer.encode(t) + [tokenizer.eod_id] for t in TEXTS * 30 if t]
    assert [d.tolist() for d in megatron_documents(tmp_path / "out" / "ds")] == expected


def test_nothing_is_said_when_the_fast_path_is_on(tmp_path, capfd, model):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS * 5)
    preprocess([source], model, tmp_path / "out" / "ds")
    assert _off_lines(capfd.readouterr().err) == []
    tokenizer = Tokenizer.from_path(model)
    expected = [tokenizer.encode(t) + [tokenizer.eod_id] for t in TEXTS * 5 if t]
    assert [d.tolist() for d in megatron_documents(tmp_path / "out" / "ds")] == expected


def test_nothing_is_said_when_the_user_turns_the_cache_off(tmp_path, capfd, unigram_model, spm_defaults_model):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    for path in (unigram_model, spm_defaults_model):
        preprocess([source], path, tmp_path / f"out_{path.parent.name}" / "ds", segment_cache_entries=0)
    assert _off_lines(capfd.readouterr().err) == []


def test_off_is_said_when_the_c_helper_is_missing(tmp_path, capfd, monkeypatch, spm_defaults_model):
    monkeypatch.setitem(sys.modules, "megatron_iiet.data._segment_table", None)  # as where no compiler was found
    assert "not built" in cache_blocker(Tokenizer.from_path(spm_defaults_model)._sp)
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    preprocess([source], spm_defaults_model, tmp_path / "out" / "ds")
    lines = _off_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "the C segment table is not built" in lines[0], lines


def test_off_is_said_for_a_hugging_face_tokenizer_directory(tmp_path, capfd, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS[:2])
    preprocess([source], small_tokenizer.parent, tmp_path / "out" / "ds")
    lines = _off_lines(capfd.readouterr().err)
    assert len(lines) == 1 and "not a sentencepiece model" in lines[0], lines


@pytest.mark.parametrize("kind", ["spm_defaults", "unigram"])
def test_text_that_is_not_unicode_is_named_on_either_path(tmp_path, request, kind):
    """A lone surrogate (valid JSON) fails with the file and line whether the text goes through
    sentencepiece's normaliser first (fast path) or straight to sp.encode (slow path)."""
    from megatron_iiet.data.errors import DataInputError

    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n', encoding="utf-8")
    with pytest.raises(DataInputError, match=r"in\.jsonl: line 2: text is not valid Unicode"):
        preprocess([source], request.getfixturevalue(f"{kind}_model"), tmp_path / "out" / "ds")
