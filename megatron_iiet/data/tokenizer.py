"""One tokenizer interface for training, evaluation, preprocessing and checkpoint conversion.

`Tokenizer.from_path` accepts a sentencepiece `.model` file or a Hugging Face tokenizer directory.
Special ids are explicit attributes (`bos_id`, `eos_id`, `eod_id`, `pad_id`; None when the
tokenizer has no such token). The end-of-document id is the EOS token: documents are
concatenated as `doc EOD doc EOD ...`, the megatron GPT convention.

`fingerprint` hashes the vocabulary (pieces in id order) and the special ids. It is stored next to
every preprocessed dataset so data made with different vocabularies is never mixed; a
sentencepiece model and the HF files exported from it share one fingerprint.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from megatron_iiet.data.errors import DataInputError, TokenizerMismatchError


def smallest_token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest unsigned/int dtype megatron's IndexedDataset can store that holds every id."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    if vocab_size <= 1 << 31:
        return np.int32
    return np.int64


def check_dtype_fits(vocab_size: int, dtype: type[np.number], source: str) -> None:
    """Raise if token ids up to vocab_size - 1 do not fit `dtype` (they would wrap silently)."""
    limit = int(np.iinfo(dtype).max)
    if vocab_size - 1 > limit:
        raise TokenizerMismatchError(
            f"{source}: vocabulary of {vocab_size} tokens does not fit dtype "
            f"{np.dtype(dtype).name} (largest id {limit}); use a wider --dtype or leave it unset"
        )


class Tokenizer:
    """Common interface; use `Tokenizer.from_path` to construct."""

    path: str
    bos_id: int | None
    eos_id: int | None
    eod_id: int | None
    pad_id: int | None
    unk_id: int | None

    @staticmethod
    def from_path(path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        if path.is_file() and path.suffix == ".model":
            return SentencePieceTokenizer(path)
        if path.is_dir():
            return HFTokenizer(path)
        if not path.exists():
            raise DataInputError(f"{path}: tokenizer not found (expected a .model file or a directory)")
        raise DataInputError(
            f"{path}: not a tokenizer (expected a sentencepiece .model file or an HF tokenizer directory)"
        )

    # -- interface ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_to_arrays(self, texts: Sequence[str], dtype_name: str, eod_id: int | None,
                         cache_segments: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Every text's ids (followed by `eod_id` unless None) as one flat `dtype_name` array,
        and each text's length. `cache_segments` only matters for sentencepiece models."""
        encoded = self.encode_batch(texts)
        eod = [] if eod_id is None else [eod_id]
        lengths = np.fromiter((len(ids) + len(eod) for ids in encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(ids, eod) for ids in encoded),
                           dtype=dtype_name, count=int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def pieces(self) -> list[str]:
        """Every token's string form, in id order (used for the fingerprint)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        if getattr(self, "_fingerprint", None) is None:
            payload = {
                "pieces": self.pieces(),
                "bos": self.bos_id,
                "eos": self.eos_id,
                "eod": self.eod_id,
                "pad": self.pad_id,
                "unk": self.unk_id,
            }
            blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            self._fingerprint = "vocab-sha256:" + hashlib.sha256(blob).hexdigest()[:32]
        return self._fingerprint

    def describe(self) -> dict:
        """What a dataset's meta.json records about the tokenizer."""
        return {
            "fingerprint": self.fingerprint,
            "path": str(self.path),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "eod_id": self.eod_id,
            "pad_id": self.pad_id,
        }


def _none_if_negative(value: int) -> int | None:
    return None if value is None or value < 0 else int(value)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece

        self.path = str(model_path)
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except (OSError, RuntimeError) as error:
            raise DataInputError(f"{self.path}: not a readable sentencepiece model ({error})") from None
        self.bos_id = _none_if_negative(self._sp.bos_id())
        self.eos_id = _none_if_negative(self._sp.eos_id())
        self.eod_id = self.eos_id
        self.pad_id = _none_if_negative(self._sp.pad_id())
        self.unk_id = _none_if_negative(self._sp.unk_id())

    @property
    def vocab_size(self) -> int:
        return int(self._sp.vocab_size())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One call for the whole batch: the C++ side loops without the per-call Python overhead.
        return self._sp.encode(list(texts), out_type=int, num_threads=1)

    def encode_to_arrays(self, texts: Sequence[str], dtype_name: str, eod_id: int | None,
                         cache_segments: bool = True) -> tuple[np.ndarray, np.ndarray]:
        cache = self.segment_cache(dtype_name) if cache_segments else None
        if cache is None:
            return super().encode_to_arrays(texts, dtype_name, eod_id)
        eod = b"" if eod_id is None else np.array([eod_id], dtype=dtype_name).tobytes()
        encoded = [cache.encode(text) + eod for text in texts]
        itemsize = np.dtype(dtype_name).itemsize
        lengths = np.fromiter((len(data) // itemsize for data in encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=dtype_name), lengths

    def segment_cache(self, dtype_name: str) -> "_SegmentCache | None":
        """The memoising encoder for this model (None when the model does not allow one;
        `segment_cache_blocker` says why)."""
        if not hasattr(self, "segment_cache_blocker"):
            self.segment_cache_blocker = _segment_cache_blocker(self._sp)
            self._segment_caches: dict[str, _SegmentCache] = {}
        if self.segment_cache_blocker is not None:
            return None
        if dtype_name not in self._segment_caches:
            self._segment_caches[dtype_name] = _SegmentCache(self._sp, dtype_name)
        return self._segment_caches[dtype_name]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer directory, loaded offline with AutoTokenizer."""

    def __init__(self, directory: str | os.PathLike) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers import AutoTokenizer

        self.path = str(directory)
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as error:
            raise DataInputError(f"{self.path}: not a loadable HF tokenizer directory ({error})") from None
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id
        self.eod_id = self.eos_id
        self.pad_id = self._tok.pad_token_id
        self.unk_id = self._tok.unk_token_id

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def pieces(self) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(range(self.vocab_size)))


# ---- memoised sentencepiece BPE encoding -------------------------------------------------------
_SPACE_KEYS = re.compile(r" ( *[^ ]*)")


def _segment_cache_blocker(sp) -> str | None:
    """Why `_SegmentCache` would not reproduce `sp.encode` for this model, or None if it does.

    The cache relies on BPE merges never joining a non-space character to a following space:
    then the text splits, before every run of spaces that follows a non-space, into segments
    that encode independently. That holds when the normaliser is the identity (no character
    map, no added or removed whitespace), and no piece holds `▁` after its first character
    unless it is all `▁` (whitespace-only pieces such as `▁▁▁▁`). Byte fallback is required so
    that every token maps to a known number of characters (no `<unk>` spans).
    """
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: cannot inspect the model, so do not assume
        return "sentencepiece_model_pb2 (protobuf) is not importable"
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(sp.serialized_model_proto())
    trainer, normalizer = model.trainer_spec, model.normalizer_spec
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        return "not a BPE model"
    if not trainer.byte_fallback:
        return "no byte fallback"
    if trainer.treat_whitespace_as_suffix:
        return "whitespace is a suffix"
    if normalizer.precompiled_charsmap or normalizer.add_dummy_prefix or normalizer.remove_extra_whitespaces:
        return "the normaliser changes the text"
    if not normalizer.escape_whitespaces:
        return "whitespace is not escaped"
    pieces = [(piece.piece, piece.type) for piece in model.pieces]
    types = sentencepiece_model_pb2.ModelProto.SentencePiece
    if any(kind == types.USER_DEFINED for _, kind in pieces):
        return "user-defined symbols"
    if not any(piece == "\u2581" and kind == types.NORMAL for piece, kind in pieces):
        return "no plain space piece"
    for piece, kind in pieces:
        if kind == types.NORMAL and "\u2581" in piece[1:] and piece.strip("\u2581"):
            return f"piece {piece!r} joins text across a space"
    return None


class _CacheMismatch(Exception):
    """Newly encoded segments did not line up with token boundaries."""


class _SegmentCache:
    """Encodes texts exactly like `sp.encode`, memoising space-separated segments.

    Per-document sentencepiece BPE costs about a microsecond per token, and most words recur,
    so each segment (a run of spaces plus the following non-space characters) is encoded once
    and its token bytes reused, the way HF tokenizers and tiktoken cache words. Segments not
    yet cached are encoded together in one `sp.encode` call on their concatenation (valid by
    the same independence property; see `_segment_cache_blocker`), and the result is cut back
    into segments by the characters each token covers; if the cut does not line up, the
    document is encoded whole instead. The cache is bounded (entries and key length), so memory
    does not grow with the input.
    """

    MAX_ENTRIES = 1 << 19  # ~130 bytes each: <= ~70 MB per worker
    MAX_KEY_CHARS = 48

    def __init__(self, sp, dtype_name: str) -> None:
        self.sp = sp
        self.dtype = np.dtype(dtype_name)
        chars = np.zeros(sp.vocab_size(), dtype=np.int64)
        for token in range(sp.vocab_size()):
            if sp.is_byte(token):
                value = int(sp.id_to_piece(token)[1:-1], 16)
                chars[token] = 0 if 0x80 <= value < 0xC0 else 1  # continuation bytes add no character
            elif not (sp.is_control(token) or sp.is_unknown(token)):
                chars[token] = len(sp.id_to_piece(token))
        self.token_chars = chars
        self.cache: dict[str, bytes] = {}  # key -> bytes of sp.encode(" " + key)
        self.segments = self.misses = 0

    def _to_bytes(self, ids) -> bytes:
        return np.asarray(ids, dtype=self.dtype).tobytes()

    def encode(self, text: str) -> bytes:
        """Token ids of `text` as bytes of `dtype` (identical to `sp.encode(text)`)."""
        if "\u2581" in text:  # a literal `▁` acts as a space inside sentencepiece: keep it simple
            return self._to_bytes(self.sp.encode(text))
        if len(self.cache) >= self.MAX_ENTRIES:
            self.cache.clear()  # crude but bounded; frequent words come back within a few documents
        try:
            return self._encode_piece(text)
        except _CacheMismatch:  # a token spanned two segments (never seen): encode it whole
            return self._to_bytes(self.sp.encode(text))

    def _encode_piece(self, text: str) -> bytes:
        if "  " in text:
            first = text.find(" ")
            head = text if first < 0 else text[:first]
            keys = _SPACE_KEYS.findall(text)  # each key: a segment without its first space
        else:
            keys = text.split(" ")
            head = keys[0]
            keys = keys[1:]
        cache = self.cache
        parts = list(map(cache.get, keys))
        self.segments += len(keys)
        if None in parts:
            missing = dict.fromkeys([key for key, part in zip(keys, parts) if part is None])
            self.misses += len(missing)
            if not self._encode_missing(missing):
                raise _CacheMismatch
            cache.update(missing)  # long keys too, for the lookup below; removed after it
            parts = list(map(cache.__getitem__, keys))
            for key in missing:
                if len(key) > self.MAX_KEY_CHARS:
                    del cache[key]  # rarely repeats; not worth the memory
        if head:  # the text before the first space: once per document, not worth caching
            parts.insert(0, self._to_bytes(self.sp.encode(head)))
        return b"".join(parts)

    def _encode_missing(self, missing: dict) -> bool:
        """Fill `missing` (key -> None) with the bytes of `sp.encode(" " + key)`; cache them."""
        joined_keys = []
        for key in missing:
            if key.strip(" "):
                joined_keys.append(key)
            else:  # only spaces (end of a text): would merge with the next segment's spaces
                missing[key] = self._to_bytes(self.sp.encode(" " + key))
        if joined_keys:
            ids = np.asarray(self.sp.encode(" " + " ".join(joined_keys)), dtype=np.int64)
            token_ends = np.cumsum(self.token_chars[ids])
            segment_ends = np.cumsum([len(key) + 1 for key in joined_keys])
            # A character beyond the vocabulary is several byte tokens; only the first counts a
            # character, so a segment ends at the last token not past its end ('right').
            cuts = np.searchsorted(token_ends, segment_ends, side="right") - 1
            if cuts[-1] != len(ids) - 1 or not np.array_equal(token_ends[cuts], segment_ends):
                return False  # a token spans two segments: the model breaks the assumption
            data = ids.astype(self.dtype).tobytes()
            itemsize = self.dtype.itemsize
            starts = np.concatenate(([0], cuts[:-1] + 1)) * itemsize
            for key, start, stop in zip(joined_keys, starts.tolist(), ((cuts + 1) * itemsize).tolist()):
                missing[key] = data[start:stop]
        return True
