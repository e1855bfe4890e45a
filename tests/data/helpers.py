"""Helpers of the data-pipeline tests (a module of its own: `from conftest import ...` resolves to
whichever conftest Python imported first, which depends on the test selection)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.forked import run_script

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


def preprocess(inputs, tokenizer, output_prefix, **overrides):
    """run_preprocess in this process, quietly, tokenizing in the main process unless told."""
    from megatron_iiet.data.preprocess import PreprocessConfig, run_preprocess

    options = dict(inputs=tuple(str(i) for i in inputs), tokenizer=str(tokenizer), output_prefix=str(output_prefix),
                   workers=0, progress=False)
    options.update(overrides)
    return run_preprocess(PreprocessConfig(**options))


def tool_command(name: str, *args) -> list[str]:
    return [sys.executable, str(REPO / "tools" / name), *map(str, args)]


def run_tool(name: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """One of tools/*.py as a process of its own (what an operator runs), forked from this one
    (tests/forked.py)."""
    return run_script(REPO / "tools" / name, args, env={**os.environ, "OMP_NUM_THREADS": "1"},
                      timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line a refused command prints, after checking it exited with 2."""
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def megatron_documents(prefix) -> list:
    """Documents as megatron-core's own IndexedDataset reads them."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    # Copies: the arrays are views of an mmap that closes when `dataset` is collected.
    return [np.array(dataset[i]) for i in range(len(dataset))]
