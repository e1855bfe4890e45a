"""Writing, checking and merging megatron-core indexed datasets (`<prefix>.bin` / `<prefix>.idx`)
with bounded memory, plus the `<prefix>.meta.json` written next to each dataset.

The .idx layout is megatron-core's (read back by `megatron.core.datasets.indexed_dataset.
IndexedDataset`): magic `MMIDIDX\\0\\0`, version u64 = 1, dtype code u8, sequence count u64,
document-index count u64, then int32 sequence lengths, int64 byte pointers and int64 document
indices. One document is one sequence here, so the document indices are 0..N.

Memory does not grow with the dataset: sequence lengths are spilled to a side file while writing
and every section is produced chunk by chunk. Nothing is imported from megatron, so worker and
CLI processes skip megatron's ~8 s import.

Atomicity: .bin and .idx are written under temporary names and renamed when complete; the
meta.json is written last, so its presence marks a finished dataset. The meta also records the
sha256 of .bin and .idx and the smallest and largest token id, so a reader can check the files
and the vocabulary without decoding anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_iiet.data.atomic import (commit_temp, remove_if_exists, remove_with_leftovers, temp_path_for,
                                       write_json_atomic, writing_to)
from megatron_iiet.data.errors import CorruptDatasetError, DataInputError, TokenizerMismatchError
from megatron_iiet.locks import exclusive_output

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
META_FORMAT = "megatron-iiet-indexed/1"
# megatron.core.datasets.indexed_dataset.DType codes.
DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
_CHUNK = 1 << 20  # entries per chunk when streaming index sections
_COPY_BYTES = 8 << 20


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + ".bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + ".idx")


def meta_path(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + ".meta.json")


def verified_path(prefix: str | os.PathLike) -> Path:
    """Where a successful checksum verification is remembered (megatron_iiet.data.checksum_cache)."""
    return Path(str(prefix) + ".verified.json")


def dataset_files(prefix: str | os.PathLike) -> list[Path]:
    return [bin_path(prefix), idx_path(prefix), meta_path(prefix)]


def remove_dataset(prefix: str | os.PathLike) -> None:
    """Delete a dataset and the temporary leftovers of interrupted writes of it (by any run: the
    caller holds the prefix's lock, so no live run of ours is writing them)."""
    remove_with_leftovers(*dataset_files(prefix), verified_path(prefix), _lengths_spill_name(prefix))


def _lengths_spill_name(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + ".lengths")


def _lengths_spill_path(prefix: str | os.PathLike) -> Path:
    return temp_path_for(_lengths_spill_name(prefix))


def _write_index(handle, dtype_name: str, lengths_file: Path, sequence_count: int) -> None:
    """Stream the .idx sections from the spilled int32 lengths file."""
    itemsize = np.dtype(dtype_name).itemsize
    handle.write(INDEX_MAGIC)
    handle.write(struct.pack("<Q", INDEX_VERSION))
    handle.write(struct.pack("<B", DTYPE_CODES[dtype_name]))
    handle.write(struct.pack("<Q", sequence_count))
    handle.write(struct.pack("<Q", sequence_count + 1))
    with open(lengths_file, "rb") as lengths:
        while chunk := lengths.read(_CHUNK * 4):
            handle.write(chunk)
    offset = 0
    with open(lengths_file, "rb") as lengths:
        while chunk := lengths.read(_CHUNK * 4):
            sizes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * itemsize
            ends = np.cumsum(sizes) + offset
            starts = ends - sizes
            handle.write(starts.astype(np.int64).tobytes())
            offset = int(ends[-1])
    for start in range(0, sequence_count + 1, _CHUNK):
        stop = min(start + _CHUNK, sequence_count + 1)
        handle.write(np.arange(start, stop, dtype=np.int64).tobytes())


class IndexedDatasetWriter:
    """Appends tokenized documents to `<prefix>.bin`; `finalize` writes the index and meta."""

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.number]) -> None:
        self.prefix = str(prefix)
        self.dtype_name = np.dtype(dtype).name
        if self.dtype_name not in DTYPE_CODES:
            raise ValueError(f"dtype {self.dtype_name} cannot be stored in an indexed dataset")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(temp_path_for(bin_path(self.prefix)), "wb")
        self._lengths = open(_lengths_spill_path(self.prefix), "wb")
        self._hash = hashlib.sha256()
        self.documents = 0
        self.tokens = 0
        self.token_ids = TokenRange()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and the length of each document."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype_name).tobytes()
        self._bin.write(data)
        self._hash.update(data)
        self._lengths.write(np.asarray(lengths, dtype=np.int32).tobytes())
        self.documents += len(lengths)
        self.tokens += int(tokens.size)
        self.token_ids = self.token_ids.including(tokens)

    def finalize(self, meta: dict) -> dict:
        """Write .idx, rename .bin/.idx into place, then write meta.json (the completion mark)."""
        self._bin.close()
        self._lengths.close()
        idx_tmp = temp_path_for(idx_path(self.prefix))
        with open(idx_tmp, "wb") as handle:
            _write_index(handle, self.dtype_name, _lengths_spill_path(self.prefix), self.documents)
        idx_hash = _file_sha256(idx_tmp)
        commit_temp(bin_path(self.prefix))
        commit_temp(idx_path(self.prefix))
        remove_if_exists(_lengths_spill_path(self.prefix))
        full_meta = {
            "format": META_FORMAT,
            "dtype": self.dtype_name,
            "documents": self.documents,
            "tokens": self.tokens,
            "bin_bytes": self.tokens * np.dtype(self.dtype_name).itemsize,
            "bin_sha256": self._hash.hexdigest(),
            "idx_sha256": idx_hash,
            **self.token_ids.as_meta(),
            **meta,
        }
        write_json_atomic(meta_path(self.prefix), full_meta)
        return full_meta

    def abort(self) -> None:
        for handle in (self._bin, self._lengths):
            if not handle.closed:
                try:
                    handle.close()
                except OSError:
                    pass  # on a full disk the final flush fails too; the file goes just below anyway
        remove_dataset(self.prefix)


def _file_sha256(path: str | os.PathLike, block_sums: list[int] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_COPY_BYTES):
            digest.update(chunk)
            if block_sums is not None:
                block_sums += block_crcs(chunk)
    return digest.hexdigest()


BLOCK_BYTES = 1 << 20
"""Granularity of the block checksums remembered at a full verification (checksum_cache samples
blocks against them at later starts); _COPY_BYTES is a multiple of it."""


def block_crcs(data: bytes) -> list[int]:
    """crc32 of each BLOCK_BYTES block of ``data`` (the last one may be shorter). crc32, not a
    cryptographic hash: it only has to notice edits, and it must not slow the full read much."""
    view = memoryview(data)
    return [zlib.crc32(view[start:start + BLOCK_BYTES]) for start in range(0, len(view), BLOCK_BYTES)]


@dataclass(frozen=True)
class TokenRange:
    """Smallest and largest token id of a dataset (None when it holds no tokens)."""

    low: int | None = None
    high: int | None = None

    def including(self, tokens: np.ndarray) -> "TokenRange":
        if not tokens.size:
            return self
        low, high = int(tokens.min()), int(tokens.max())
        if self.low is None:
            return TokenRange(low, high)
        return TokenRange(min(self.low, low), max(self.high, high))

    def joined(self, other: "TokenRange") -> "TokenRange":
        if other.low is None:
            return self
        return self.including(np.array([other.low, other.high]))

    def as_meta(self) -> dict:
        return {"min_token_id": self.low, "max_token_id": self.high}

    @staticmethod
    def from_meta(meta: dict) -> "TokenRange | None":
        """The range recorded at preprocessing; None for datasets made before it was recorded."""
        if "max_token_id" not in meta:
            return None
        return TokenRange(meta.get("min_token_id"), meta["max_token_id"])


@dataclass(frozen=True)
class IndexInfo:
    prefix: str
    dtype_name: str
    sequence_count: int
    document_index_count: int
    tokens: int

    @property
    def documents(self) -> int:
        return self.document_index_count - 1


def read_meta(prefix: str | os.PathLike) -> dict:
    path = meta_path(prefix)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptDatasetError(f"{path}: missing (every dataset needs its meta.json with the tokenizer fingerprint)") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise CorruptDatasetError(f"{path}: unreadable meta.json ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise CorruptDatasetError(f"{path}: not a {META_FORMAT} meta file")
    return meta


def _read_array(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    return np.fromfile(path, dtype=dtype, count=count, offset=offset)


def verify_dataset(prefix: str | os.PathLike, check_checksums: bool = False) -> IndexInfo:
    """Check a dataset's structure (and optionally its checksums) against its index and meta.

    Raises CorruptDatasetError naming the file and what is wrong. Memory stays bounded: sections
    are read in chunks.
    """
    prefix = str(prefix)
    idx, binf = idx_path(prefix), bin_path(prefix)
    for path in (idx, binf):
        if not path.is_file():
            raise CorruptDatasetError(f"{path}: missing")
    idx_size = idx.stat().st_size
    if idx_size < HEADER_BYTES:
        raise CorruptDatasetError(f"{idx}: truncated ({idx_size} bytes, header needs {HEADER_BYTES})")
    with open(idx, "rb") as handle:
        header = handle.read(HEADER_BYTES)
    if header[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise CorruptDatasetError(f"{idx}: not a megatron index (bad magic bytes)")
    version, code, sequences, doc_entries = struct.unpack("<QBQQ", header[len(INDEX_MAGIC):])
    if version != INDEX_VERSION:
        raise CorruptDatasetError(f"{idx}: unsupported index version {version}")
    if code not in CODE_DTYPES:
        raise CorruptDatasetError(f"{idx}: unknown dtype code {code}")
    expected_idx = HEADER_BYTES + sequences * (4 + 8) + doc_entries * 8
    if idx_size != expected_idx:
        raise CorruptDatasetError(
            f"{idx}: truncated or corrupted ({idx_size} bytes; header promises {expected_idx})"
        )
    dtype_name = CODE_DTYPES[code]
    itemsize = np.dtype(dtype_name).itemsize
    tokens = 0
    for start in range(0, sequences, _CHUNK):
        count = min(_CHUNK, sequences - start)
        lengths = _read_array(idx, np.int32, HEADER_BYTES + start * 4, count).astype(np.int64)
        pointers = _read_array(idx, np.int64, HEADER_BYTES + sequences * 4 + start * 8, count)
        if (lengths < 0).any():
            raise CorruptDatasetError(f"{idx}: negative sequence length near sequence {start}")
        expected = tokens * itemsize + np.concatenate(([0], np.cumsum(lengths)[:-1])) * itemsize
        if not np.array_equal(pointers, expected):
            raise CorruptDatasetError(f"{idx}: sequence pointers disagree with lengths near sequence {start}")
        tokens += int(lengths.sum())
    doc_offset = HEADER_BYTES + sequences * 12
    if doc_entries:
        first = _read_array(idx, np.int64, doc_offset, 1)[0]
        last = _read_array(idx, np.int64, doc_offset + (doc_entries - 1) * 8, 1)[0]
        if first != 0 or last != sequences:
            raise CorruptDatasetError(f"{idx}: document indices do not span the sequences")
    bin_size = binf.stat().st_size
    if bin_size != tokens * itemsize:
        raise CorruptDatasetError(
            f"{binf}: truncated or corrupted ({bin_size} bytes; index expects {tokens * itemsize})"
        )
    if meta_path(prefix).exists():
        meta = read_meta(prefix)
        if meta.get("tokens") != tokens or meta.get("documents") != doc_entries - 1 or meta.get("dtype") != dtype_name:
            raise CorruptDatasetError(f"{meta_path(prefix)}: disagrees with {idx} (tokens, documents or dtype)")
        if check_checksums:
            check_checksums_and_token_ids(prefix)
    return IndexInfo(prefix, dtype_name, sequences, doc_entries, tokens)


def check_checksums_and_token_ids(prefix: str | os.PathLike, blocks: dict | None = None) -> TokenRange:
    """Read .bin and .idx in full once: compare their sha256 with the meta.json's, and find the
    token id range in the same pass. Raises CorruptDatasetError naming the differing file.
    ``blocks``: filled with each file's ``block_crcs`` ({"bin": [...], "idx": [...]}) in the same
    pass."""
    prefix = str(prefix)
    meta = read_meta(prefix)
    dtype = np.dtype(meta["dtype"])
    digest, token_ids = hashlib.sha256(), TokenRange()
    if blocks is not None:
        blocks.update(bin=[], idx=[])
    with open(bin_path(prefix), "rb") as handle:
        while chunk := handle.read(_COPY_BYTES):  # a multiple of every itemsize
            digest.update(chunk)
            token_ids = token_ids.including(np.frombuffer(chunk, dtype=dtype))
            if blocks is not None:
                blocks["bin"] += block_crcs(chunk)
    actual = {"bin_sha256": digest.hexdigest(),
              "idx_sha256": _file_sha256(idx_path(prefix), None if blocks is None else blocks["idx"])}
    for path, key in ((bin_path(prefix), "bin_sha256"), (idx_path(prefix), "idx_sha256")):
        if key in meta and actual[key] != meta[key]:
            raise CorruptDatasetError(f"{path}: checksum differs from {meta_path(prefix).name}; the file is corrupted")
    return token_ids


def merge_datasets(prefixes: list[str], out_prefix: str | os.PathLike, extra_meta: dict | None = None, *,
                   overwrite: bool = False) -> dict:
    """Concatenate datasets (same dtype and tokenizer) into one, streaming every section.

    The result is byte-identical to writing all documents into one dataset directly. Each input's
    .bin is checked against its recorded checksum while it is copied. An input is never the
    output (the merge would replace it); an existing output is replaced only with `overwrite`.
    """
    if not prefixes:
        raise ValueError("nothing to merge")
    out_prefix = str(out_prefix)
    for prefix in prefixes:
        if _same_dataset(prefix, out_prefix):
            raise DataInputError(f"{out_prefix}: is one of the inputs ({prefix}); merging into it would replace it: "
                                 "choose another output prefix")
    with writing_to(Path(out_prefix).parent), exclusive_output(out_prefix, "another run writing this dataset",
                                                               "wait for it to finish or choose another output prefix"):
        # Under the lock: a dataset finished meanwhile by another job counts as existing.
        existing = [p for p in (meta_path(out_prefix), bin_path(out_prefix), idx_path(out_prefix)) if p.exists()]
        if existing and not overwrite:
            raise DataInputError(f"{existing[0]}: exists; pass --overwrite to replace the dataset {out_prefix}, or "
                                 "choose another output prefix")
        return _merge_datasets(prefixes, out_prefix, extra_meta)


def _same_dataset(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two prefixes name one dataset: the same path once links are resolved, or a .bin
    that is one file (a hard link, a link to the file itself)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(bin_path(a), bin_path(b))
    except OSError:  # one of them does not exist
        return False


def _merge_datasets(prefixes: list[str], out_prefix: str, extra_meta: dict | None) -> dict:
    infos = [verify_dataset(p) for p in prefixes]
    metas = [read_meta(p) for p in prefixes]
    dtypes = {info.dtype_name for info in infos}
    if len(dtypes) != 1:
        raise CorruptDatasetError(f"cannot merge datasets of different dtypes: {sorted(dtypes)}")
    fingerprints = {m["tokenizer"]["fingerprint"] for m in metas}
    if len(fingerprints) != 1:
        raise TokenizerMismatchError(f"cannot merge datasets made with different tokenizers: {sorted(fingerprints)}")
    dtype_name = dtypes.pop()
    itemsize = np.dtype(dtype_name).itemsize
    total_sequences = sum(i.sequence_count for i in infos)
    total_doc_entries = sum(i.document_index_count - 1 for i in infos) + 1
    bin_tmp, idx_tmp = temp_path_for(bin_path(out_prefix)), temp_path_for(idx_path(out_prefix))
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    bin_hash = hashlib.sha256()
    try:
        with open(bin_tmp, "wb") as out:
            for prefix, meta in zip(prefixes, metas):
                part_hash = hashlib.sha256()
                with open(bin_path(prefix), "rb") as part:
                    while chunk := part.read(_COPY_BYTES):
                        out.write(chunk)
                        part_hash.update(chunk)
                        bin_hash.update(chunk)
                if meta.get("bin_sha256") and part_hash.hexdigest() != meta["bin_sha256"]:
                    raise CorruptDatasetError(f"{bin_path(prefix)}: checksum differs from its meta.json; the file is corrupted")
        with open(idx_tmp, "wb") as out:
            out.write(INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, DTYPE_CODES[dtype_name], total_sequences, total_doc_entries))
            for info in infos:  # lengths
                _copy_section(out, idx_path(info.prefix), HEADER_BYTES, info.sequence_count, np.int32, 0)
            byte_offset = 0
            for info in infos:  # pointers, shifted by the bytes of the datasets before
                _copy_section(out, idx_path(info.prefix), HEADER_BYTES + info.sequence_count * 4, info.sequence_count, np.int64, byte_offset)
                byte_offset += info.tokens * itemsize
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            sequence_offset = 0
            for info in infos:  # document indices without each part's leading 0
                start = HEADER_BYTES + info.sequence_count * 12 + 8
                _copy_section(out, idx_path(info.prefix), start, info.document_index_count - 1, np.int64, sequence_offset)
                sequence_offset += info.sequence_count
        idx_hash = _file_sha256(idx_tmp)
        commit_temp(bin_path(out_prefix))
        commit_temp(idx_path(out_prefix))
    except BaseException:
        remove_if_exists(bin_tmp, idx_tmp)
        raise
    meta = {
        "format": META_FORMAT,
        "dtype": dtype_name,
        "documents": total_doc_entries - 1,
        "tokens": sum(i.tokens for i in infos),
        "bin_bytes": sum(i.tokens for i in infos) * itemsize,
        "bin_sha256": bin_hash.hexdigest(),
        "idx_sha256": idx_hash,
        **_merged_token_range(metas),
        "tokenizer": metas[0]["tokenizer"],
        "merged_from": [os.path.basename(p) for p in prefixes],
        **(extra_meta or {}),
    }
    write_json_atomic(meta_path(out_prefix), meta)
    return meta


def _merged_token_range(metas: list[dict]) -> dict:
    """The parts' recorded token ranges joined; nothing when a part has none recorded."""
    ranges = [TokenRange.from_meta(meta) for meta in metas]
    if any(r is None for r in ranges):
        return {}
    merged = TokenRange()
    for part in ranges:
        merged = merged.joined(part)
    return merged.as_meta()


def _copy_section(out, path: Path, offset: int, count: int, dtype, shift: int) -> None:
    itemsize = np.dtype(dtype).itemsize
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        values = _read_array(path, dtype, offset + start * itemsize, n)
        if shift:
            values = values + np.asarray(shift, dtype=dtype)
        out.write(values.astype(dtype).tobytes())
