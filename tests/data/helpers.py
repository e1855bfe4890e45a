"""Helpers of the data-pipeline tests (a module of its own: `from conftest import ...` resolves to
whichever conftest Python imported first, which depends on the test selection)."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    return Path(os.environ.get("IIET_SHARED_DATA", REPO.parent / "shared" / "data"))


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
