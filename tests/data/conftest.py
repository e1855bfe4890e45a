"""Fixtures for the data-pipeline tests: a small tokenizer trained once per session, and the
location of the shared real-data directory (../shared/data, or $IIET_SHARED_DATA)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def shared_data_dir() -> Path:
    return Path(os.environ.get("IIET_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "gutenberg").is_dir():
        pytest.skip(f"shared data not found at {path} (set IIET_SHARED_DATA to the directory holding gutenberg/)")
    return path


def gutenberg_paragraphs(shared: Path, books: int = 3, limit: int | None = None) -> list[str]:
    """Paragraphs (CRLF kept) of the first `books` Gutenberg books, boilerplate stripped."""
    from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

    paragraphs: list[str] = []
    for path in sorted((shared / "gutenberg").glob("*.txt"))[:books]:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            text = handle.read()
        body = strip_gutenberg_boilerplate(text, str(path))
        paragraphs.extend(p for p in body.split("\r\n\r\n") if p.strip())
    return paragraphs[:limit] if limit else paragraphs


def write_jsonl(path: Path, texts: list, key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({key: text}) + "\n")
    return path


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """BPE, vocab 600, trained on 1 MB of the built-in corpus (about a second)."""
    from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TokenizerTrainingConfig(inputs=("builtin:python-stdlib:1MB",), output_dir=str(out), vocab_size=600))
    return out / "tokenizer.model"
