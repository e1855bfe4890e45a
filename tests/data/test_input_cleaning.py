"""Input cleaning in the tokenizer and preprocessing tools: a byte-order mark never reaches the
tokenizer, and `--strip gutenberg` keeps the book between Project Gutenberg's START / END lines,
on the real books of the shared data."""

from __future__ import annotations

import numpy as np

from tests.data.helpers import megatron_documents, one_line_error, run_tool


def _decode(prefix, tokenizer_model) -> list[str]:
    from megatron_iiet.data.tokenizer import Tokenizer

    tok = Tokenizer.from_path(str(tokenizer_model))
    return [tok.decode([int(t) for t in np.asarray(doc) if int(t) != tok.eod_id])
            for doc in megatron_documents(prefix)]


def test_strip_gutenberg_in_both_tools_on_real_books(shared_data, tmp_path):
    from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

    books = [p for p in sorted((shared_data / "gutenberg").glob("*-0.txt"))
             if p.read_bytes().startswith(b"\xef\xbb\xbf")][:2]  # UTF-8 files with a BOM
    assert len(books) == 2, "the shared Gutenberg books should include UTF-8 files with a BOM"
    tok_dir = tmp_path / "tok"
    proc = run_tool("train_tokenizer.py", "--input", *books, "--output-dir", tok_dir,
                    "--vocab-size", "800", "--strip", "gutenberg")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    assert not any("\ufeff" in p for p in pieces), "the BOM became a piece"
    for strip, expect_header in ((["--strip", "gutenberg"], False), ([], True)):
        prefix = tmp_path / f"books{len(strip)}"
        proc = run_tool("preprocess_data.py", "--input", *books, "--tokenizer",
                        tok_dir / "tokenizer.model", "--output-prefix", prefix, "--workers", "0",
                        "--no-progress", *strip)
        assert proc.returncode == 0, proc.stderr[-3000:]
        texts = _decode(prefix, tok_dir / "tokenizer.model")
        assert len(texts) == 2
        for book, text in zip(books, texts):
            raw = book.read_text(encoding="utf-8")
            assert not text.startswith("\ufeff")
            assert ("Project Gutenberg License" in text) == expect_header
            if not expect_header:
                body = strip_gutenberg_boilerplate(raw[1:], str(book))
                # byte fallback makes decoding exact up to the tokenizer's whitespace handling
                assert text.split() == body.split()


def test_strip_gutenberg_refuses_a_text_without_markers_and_line_units(small_tokenizer, tmp_path):
    plain = tmp_path / "notes.txt"
    plain.write_text("just some notes\nno markers here\n")
    line = one_line_error(run_tool("preprocess_data.py", "--input", plain, "--tokenizer",
                                   small_tokenizer, "--output-prefix", tmp_path / "out",
                                   "--workers", "0", "--no-progress", "--strip", "gutenberg"))
    assert "notes.txt: no '*** START OF'" in line
    line = one_line_error(run_tool("train_tokenizer.py", "--input", plain, "--output-dir",
                                   tmp_path / "tok", "--strip", "gutenberg", "--text-unit", "line"))
    assert "whole documents" in line
    assert not (tmp_path / "out.bin").exists()
