"""Input resolution and streaming document reading.

Inputs are files, globs, directories (searched recursively) or a built-in corpus name. Files are
read one at a time through HF `datasets` in streaming mode, so memory does not grow with the
input. Every document carries its position (file index, row within the file) so a resumed run
can skip straight to where the last finished shard ended.

Errors name the file and the record (line for jsonl/text, row for tables).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

from megatron_iiet.data.corpus import builtin_corpus_files, is_builtin
from megatron_iiet.data.errors import DataInputError

# File suffix -> HF datasets builder. Compression suffixes are stripped first (HF decompresses).
_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
_COMPRESSION = {".gz", ".bz2", ".xz", ".zst"}
WHOLE_FILE = "whole-file"  # built-in corpus files: one document per file, read directly
TEXT_UNITS = ("document", "paragraph", "line")


@dataclass(frozen=True)
class InputFile:
    path: str
    builder: str
    size: int


@dataclass(frozen=True)
class ReaderConfig:
    text_key: str = "text"
    # How a .txt file splits into documents: the whole file, blank-line paragraphs, or lines.
    text_unit: str = "document"
    # Uncompressed .jsonl and .txt are read directly by default (same rows as HF datasets, without
    # its ~2-4 s / ~350 MB import of datasets+torch); True sends them through HF datasets too.
    hf_reader: bool = False
    # Directly read .jsonl lines come as `JsonLine`s, parsed later by `parse_json_line` (so that
    # preprocessing workers, not the reading process, pay for JSON decoding).
    defer_json: bool = False
    # corpus.clean_text's `strip` (e.g. "gutenberg"); a leading byte-order mark always goes.
    # Stripping needs whole documents, so it parses jsonl here (no deferred JsonLine).
    strip: str | None = None


class JsonLine(NamedTuple):
    """An unparsed jsonl line and where it is, for errors."""

    raw: bytes
    path: str
    line: int  # 1-based line number in the file


@dataclass(frozen=True)
class Document:
    file_index: int
    row: int  # 0-based row within the file
    text: str | None | JsonLine  # None: the record had no text (null); counted as skipped


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _input_file(path: Path, spec: str) -> InputFile:
    builder = _builder_for(path)
    if builder is None:
        known = ", ".join(sorted(_BUILDERS))
        raise DataInputError(f"{path}: unsupported file type (from input {spec!r}; known: {known})")
    size = path.stat().st_size
    if size == 0:
        raise DataInputError(f"{path}: file is empty (from input {spec!r}); remove it or fix the input list")
    return InputFile(str(path), builder, size)


def resolve_inputs(specs: list[str]) -> list[InputFile]:
    """Expand files, globs, directories and `builtin:` names into an ordered file list."""
    if not specs:
        raise DataInputError("no input given (pass files, globs, directories or builtin:python-stdlib)")
    files: list[InputFile] = []
    for spec in specs:
        if is_builtin(spec):
            files.extend(InputFile(f.path, WHOLE_FILE, f.size) for f in builtin_corpus_files(spec))
            continue
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _builder_for(p))
            if not found:
                raise DataInputError(f"{spec}: directory holds no readable data files")
            files.extend(_input_file(p, spec) for p in found)
        elif path.is_file():
            files.append(_input_file(path, spec))
        elif glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataInputError(f"{spec}: pattern matches no files")
            files.extend(_input_file(p, spec) for p in matches)
        else:
            raise DataInputError(f"{spec}: no such file or directory")
    return files


def inputs_signature(files: list[InputFile]) -> list[list]:
    """What identifies the input of a run: path, size and mtime of each file (a resume or re-run
    refuses an input edited since, even one edited in place to the same size). The mtime stands in
    for the content: hashing every input again on each re-run would cost a full read of it."""
    return [[os.path.abspath(f.path), f.size, os.stat(f.path).st_mtime_ns] for f in files]


def record_word(builder: str) -> str:
    return "line" if builder in ("json", "text") else "row"


def _first_bad_utf8_line(path: str) -> tuple[int, str] | None:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return number, str(error)
    return None


def _first_bad_json_line(path: str) -> tuple[int, str] | None:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                json.loads(raw)
            except ValueError as error:
                return number, str(error)
    return None


def _json_record_has_key(path: str, row: int, key: str) -> bool:
    """Whether record `row` (0-based, blank lines not counted) of a jsonl file has `key`.
    Only called for null texts, which are rare, so the linear scan is acceptable."""
    with open(path, "rb") as handle:
        records = (line for line in handle if line.strip())
        for index, raw in enumerate(records):
            if index == row:
                try:
                    return key in json.loads(raw)
                except ValueError:
                    return True  # a .json array file, not jsonl: cannot tell, treat as null
    return True


def _explain_read_error(input_file: InputFile, row: int, error: Exception) -> DataInputError:
    """Turn a reader exception into an error naming the file and the offending line."""
    path = input_file.path
    if isinstance(error, UnicodeDecodeError) or "utf-8" in str(error).lower() or "encoding" in str(error).lower():
        found = _first_bad_utf8_line(path)
        if found:
            return DataInputError(f"{path}: line {found[0]}: invalid UTF-8 ({found[1]})")
    if input_file.builder == "json":
        found = _first_bad_json_line(path)
        if found:
            return DataInputError(f"{path}: line {found[0]}: invalid JSON ({found[1]})")
    word = record_word(input_file.builder)
    return DataInputError(f"{path}: {word} {row + 1}: cannot read ({type(error).__name__}: {error})")


def _hf_rows(input_file: InputFile, config: ReaderConfig, start_row: int):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    kwargs = {}
    if input_file.builder == "text":
        kwargs["sample_by"] = config.text_unit
        kwargs["keep_linebreaks"] = True
    dataset = datasets.load_dataset(
        input_file.builder, data_files=[input_file.path], split="train", streaming=True, **kwargs
    )
    if start_row:
        dataset = dataset.skip(start_row)
    return iter(dataset)


def _direct_format(input_file: InputFile) -> str | None:
    """'jsonl' or 'text' for the uncompressed files the direct reader handles, else None."""
    suffix = Path(input_file.path).suffix.lower()
    if input_file.builder == "json" and suffix == ".jsonl":
        return "jsonl"
    if input_file.builder == "text" and suffix in (".txt", ".text"):
        return "text"
    return None


def parse_json_line(line: JsonLine, key: str) -> str | None:
    """The `key` text of one jsonl line (None for a null), or an error naming file and line."""
    path, number = line.path, line.line
    try:
        record = json.loads(line.raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise DataInputError(f"{path}: line {number}: invalid UTF-8 ({error})") from None
    except ValueError as error:
        raise DataInputError(f"{path}: line {number}: invalid JSON ({error})") from None
    if not isinstance(record, dict):
        raise DataInputError(f"{path}: line {number}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        fields = ", ".join(sorted(record)) or "none"
        raise DataInputError(f"{path}: line {number}: no field {key!r} (fields: {fields}); choose the text field with --text-key")
    text = record[key]
    if text is not None and not isinstance(text, str):
        raise DataInputError(f"{path}: line {number}: field {key!r} holds {type(text).__name__}, not text")
    return text


def _direct_jsonl(input_file: InputFile, file_index: int, config: ReaderConfig, start_row: int) -> Iterator[Document]:
    """Rows of a jsonl file as HF datasets numbers them (blank lines are not rows)."""
    path, row = input_file.path, 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if row >= start_row:
                line = JsonLine(raw, path, number)
                yield Document(file_index, row, line if config.defer_json else parse_json_line(line, config.text_key))
            row += 1


def _direct_text_rows(path: str, unit: str) -> Iterator[str]:
    """The rows HF datasets' text builder yields (universal newlines, line breaks kept)."""
    with open(path, encoding="utf-8") as handle:
        if unit == "document":
            yield handle.read()
        elif unit == "line":
            yield from handle
        else:  # paragraphs: split on blank lines, empty pieces dropped, read in chunks
            rest = ""
            while chunk := handle.read(1 << 22):
                pieces = (rest + chunk).split("\n\n")
                rest = pieces.pop()
                yield from (piece for piece in pieces if piece)
            if rest:
                yield rest


def _direct_text(input_file: InputFile, file_index: int, unit: str, start_row: int) -> Iterator[Document]:
    rows = _direct_text_rows(input_file.path, unit)
    try:
        for row, text in enumerate(rows):
            if row >= start_row:
                yield Document(file_index, row, text)
    except UnicodeDecodeError:
        found = _first_bad_utf8_line(input_file.path)
        raise DataInputError(f"{input_file.path}: line {found[0] if found else '?'}: invalid UTF-8") from None


def iter_file_documents(input_file: InputFile, file_index: int, config: ReaderConfig, start_row: int = 0) -> Iterator[Document]:
    direct = None if config.hf_reader else _direct_format(input_file)
    if direct == "jsonl":
        yield from _direct_jsonl(input_file, file_index, config, start_row)
        return
    if direct == "text":
        yield from _direct_text(input_file, file_index, config.text_unit, start_row)
        return
    if input_file.builder == WHOLE_FILE:
        if start_row == 0:
            try:
                text = Path(input_file.path).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                found = _first_bad_utf8_line(input_file.path)
                line = found[0] if found else "?"
                raise DataInputError(f"{input_file.path}: line {line}: invalid UTF-8") from None
            yield Document(file_index, 0, text)
        return
    row = start_row
    try:
        rows = _hf_rows(input_file, config, start_row)
    except Exception as error:  # noqa: BLE001 - every reader failure becomes a located error
        raise _explain_read_error(input_file, row, error) from None
    key = config.text_key
    while True:
        try:
            record = next(rows)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001
            raise _explain_read_error(input_file, row, error) from None
        if key not in record:
            fields = ", ".join(sorted(record)) or "none"
            raise DataInputError(
                f"{input_file.path}: {record_word(input_file.builder)} {row + 1}: no field {key!r} "
                f"(fields: {fields}); choose the text field with --text-key"
            )
        text = record[key]
        if text is None and input_file.builder == "json" and not _json_record_has_key(input_file.path, row, key):
            # Arrow fills a field missing from one record with null; a real null is skipped,
            # a missing field is an error.
            fields = ", ".join(sorted(k for k, v in record.items() if v is not None)) or "none"
            raise DataInputError(
                f"{input_file.path}: line {row + 1}: no field {key!r} (fields: {fields}); "
                "choose the text field with --text-key"
            )
        if text is not None and not isinstance(text, str):
            raise DataInputError(
                f"{input_file.path}: {record_word(input_file.builder)} {row + 1}: field {key!r} holds "
                f"{type(text).__name__}, not text"
            )
        yield Document(file_index, row, text)
        row += 1


def iter_documents(files: list[InputFile], config: ReaderConfig, start_file: int = 0, start_row: int = 0) -> Iterator[Document]:
    """All documents of all files, in order, starting at (start_file, start_row), cleaned
    (corpus.clean_text)."""
    from megatron_iiet.data.corpus import clean_text

    if config.strip is not None and config.text_unit != "document":
        raise DataInputError(f"--strip {config.strip} needs whole documents; it cannot be "
                             f"combined with --text-unit {config.text_unit}")
    for index in range(start_file, len(files)):
        for document in iter_file_documents(files[index], index, config, start_row if index == start_file else 0):
            text = document.text
            if isinstance(text, JsonLine) and config.strip is not None:
                text = parse_json_line(text, config.text_key)
            if isinstance(text, str):
                one_document = files[index].builder in ("text", WHOLE_FILE) and config.text_unit == "document"
                where = files[index].path if one_document else \
                    f"{files[index].path} ({record_word(files[index].builder)} {document.row + 1})"
                text = clean_text(text, config.strip, where)
                document = Document(document.file_index, document.row, text)
            yield document
