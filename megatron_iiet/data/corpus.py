"""Built-in corpora that exist on every machine without a download, and small text helpers.

`builtin:python-stdlib` is the source (code, comments and docstrings) of the running Python's
standard library, without its test suites: a few tens of MB of real, mostly English-commented
code. Append a size to take a deterministic prefix of it, e.g. `builtin:python-stdlib:4MB`
(files in sorted path order until the size is reached). Each file is one document.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from megatron_iiet.data.errors import DataInputError

BUILTIN_PREFIX = "builtin:"
PYTHON_STDLIB = "python-stdlib"
DEFAULT_CORPUS = f"{BUILTIN_PREFIX}{PYTHON_STDLIB}:4MB"

# Test suites are huge, repetitive and full of deliberately odd encodings; vendored packages are
# not the standard library's own text.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


@dataclass(frozen=True)
class CorpusFile:
    path: str
    size: int


def is_builtin(spec: str) -> bool:
    return spec.startswith(BUILTIN_PREFIX)


def parse_size(text: str, what: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise DataInputError(f"{what}: cannot read size {text!r} (examples: 4MB, 500KB, 2GB)")
    unit = match.group(2)
    if unit in ("K", "M", "G"):
        unit += "B"
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def builtin_corpus_files(spec: str) -> list[CorpusFile]:
    """The files of a `builtin:NAME[:SIZE]` corpus, in a stable order."""
    body = spec[len(BUILTIN_PREFIX):]
    name, _, size_text = body.partition(":")
    if name != PYTHON_STDLIB:
        raise DataInputError(f"{spec}: unknown built-in corpus (available: {BUILTIN_PREFIX}{PYTHON_STDLIB}[:SIZE])")
    limit = parse_size(size_text, spec) if size_text else None
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[CorpusFile] = []
    total = 0
    for path in sorted(_stdlib_sources(root), key=lambda p: p.relative_to(root).as_posix()):
        size = path.stat().st_size
        if size == 0:
            continue  # empty __init__.py files are not documents
        files.append(CorpusFile(str(path), size))
        total += size
        if limit is not None and total >= limit:
            break
    if not files:
        raise DataInputError(f"{spec}: no Python sources found under {root}")
    return files


def _stdlib_sources(root: Path):
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        for name in names:
            if name.endswith(".py"):
                yield Path(directory) / name


def builtin_corpus_description(spec: str) -> str:
    return f"{spec} (Python {sys.version.split()[0]} standard library sources, tests excluded)"


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF", re.MULTILINE)


def strip_gutenberg_boilerplate(text: str, source: str = "<text>") -> str:
    """The book between the `*** START OF` and `*** END OF` lines of a Project Gutenberg file."""
    start = _GUTENBERG_START.search(text)
    end = _GUTENBERG_END.search(text)
    if not start or not end or end.start() < start.end():
        raise DataInputError(f"{source}: no '*** START OF' / '*** END OF' lines; not a Project Gutenberg text")
    body = text[start.end():end.start()]
    return body.lstrip("\r\n")


STRIP_CHOICES = ("gutenberg",)


def clean_text(text: str, strip: str | None = None, source: str = "<text>") -> str:
    """What every document goes through before the tokenizer sees it: a byte-order mark at its
    start is dropped (a file's encoding marker, not text: sentencepiece would learn it and spend
    a token on it in every file), and ``strip="gutenberg"`` keeps only the book between Project
    Gutenberg's START / END lines (header and licence are ~2% of a book's tokens)."""
    if text.startswith("\ufeff"):
        text = text[1:]
    if strip == "gutenberg":
        text = strip_gutenberg_boilerplate(text, source)
    elif strip is not None:
        raise DataInputError(f"--strip {strip}: unknown (choose from {', '.join(STRIP_CHOICES)})")
    return text
