"""One tokenizer interface for training, evaluation, preprocessing and checkpoint conversion.

`Tokenizer.from_path` accepts a sentencepiece `.model` file or a Hugging Face tokenizer directory.
Special ids are explicit attributes (`bos_id`, `eos_id`, `eod_id`, `pad_id`; None when the
tokenizer has no such token). The end-of-document id is the EOS token: documents are
concatenated as `doc EOD doc EOD ...`, the megatron GPT convention.

`fingerprint` hashes the whole tokenizer: the serialized sentencepiece model proto (pieces, scores,
merge order, normalizer, special ids) or, for an HF directory without a `tokenizer.model`, its
serialized `tokenizer.json`, with the special ids. It is stored next to every preprocessed
dataset and in every checkpoint so data made with different tokenizers is never mixed; a
sentencepiece model and the HF files exported from it (which carry a copy of the model) share one
fingerprint. Datasets and checkpoints made before recorded `legacy_fingerprint` (pieces in id
order and special ids only: it cannot tell two merge orders apart); `fingerprint_matches` still
accepts it for the same tokenizer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from megatron_iiet.data.bpe_cache import SegmentCachedEncoder, cache_blocker, raise_if_unencodable
from megatron_iiet.data.errors import DataInputError, TokenizerMismatchError


# fingerprint -> legacy_fingerprint of every tokenizer loaded in this process: a recorded legacy
# fingerprint is compared with the current one through it, so callers pass plain strings.
_LEGACY_OF: dict[str, str] = {}


def fingerprint_matches(recorded: str | None, current: str) -> bool:
    """Whether ``recorded`` (from a dataset, checkpoint or index) names the tokenizer whose
    ``fingerprint`` is ``current``: the same fingerprint, or that tokenizer's legacy one."""
    return recorded == current or (recorded is not None and _LEGACY_OF.get(current) == recorded)


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
        """Every token's string form, in id order (used for the legacy fingerprint)."""
        raise NotImplementedError

    def _serialized(self) -> tuple[str, bytes] | None:
        """(kind, bytes) of the whole tokenizer as saved, for the fingerprint; None when there
        is no such form (the fingerprint is then the legacy one)."""
        return None

    # -- the preprocessing fast path ---------------------------------------------------------------
    @property
    def segment_cache_blocker(self) -> str | None:
        """Why `segment_cache` gives no memoising encoder for this tokenizer (one line), or None."""
        return "not a sentencepiece model (the segment cache serves sentencepiece BPE models)"

    def segment_cache(self, dtype_name: str) -> SegmentCachedEncoder | None:
        """The memoising encoder preprocessing uses, or None (`segment_cache_blocker` says why)."""
        return None

    # -- shared --------------------------------------------------------------------------------
    def _special_ids(self) -> dict:
        return {"bos": self.bos_id, "eos": self.eos_id, "eod": self.eod_id, "pad": self.pad_id,
                "unk": self.unk_id}

    @property
    def legacy_fingerprint(self) -> str:
        """What earlier versions recorded: the pieces in id order and the special ids."""
        if getattr(self, "_legacy_fingerprint", None) is None:
            payload = {"pieces": self.pieces(), **self._special_ids()}
            blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            self._legacy_fingerprint = "vocab-sha256:" + hashlib.sha256(blob).hexdigest()[:32]
        return self._legacy_fingerprint

    @property
    def fingerprint(self) -> str:
        if getattr(self, "_fingerprint", None) is None:
            serialized = self._serialized()
            if serialized is None:
                self._fingerprint = self.legacy_fingerprint
            else:
                kind, blob = serialized
                digest = hashlib.sha256(json.dumps(self._special_ids()).encode("utf-8"))
                digest.update(blob)
                self._fingerprint = f"{kind}-sha256:" + digest.hexdigest()[:32]
            _LEGACY_OF[self._fingerprint] = self.legacy_fingerprint
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
        try:
            return self._sp.encode(list(texts), out_type=int, num_threads=1)
        except (RuntimeError, TypeError):
            raise_if_unencodable(texts)  # a lone surrogate: the same error as the fast path's
            raise

    def encode_to_arrays(self, texts: Sequence[str], dtype_name: str, eod_id: int | None,
                         cache_segments: bool = True) -> tuple[np.ndarray, np.ndarray]:
        encoder = self.segment_cache(dtype_name) if cache_segments else None
        if encoder is None:
            return super().encode_to_arrays(texts, dtype_name, eod_id)
        encoded = encoder.encode_batch(texts)
        itemsize = np.dtype(dtype_name).itemsize
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) // itemsize
        if eod_id is None or not encoded:
            return np.frombuffer(b"".join(encoded), dtype=dtype_name), lengths
        eod = np.array([eod_id], dtype=dtype_name).tobytes()
        return np.frombuffer(eod.join(encoded) + eod, dtype=dtype_name), lengths + 1

    @property
    def segment_cache_blocker(self) -> str | None:
        if not hasattr(self, "_segment_cache_blocker"):
            self._segment_cache_blocker = cache_blocker(self._sp)
        return self._segment_cache_blocker

    def segment_cache(self, dtype_name: str) -> SegmentCachedEncoder | None:
        """The memoising encoder for this model (None when the model does not allow one, or the C
        helper is not built; `segment_cache_blocker` says why). One per dtype, kept."""
        if self.segment_cache_blocker is not None:
            return None
        caches = self.__dict__.setdefault("_segment_caches", {})
        if dtype_name not in caches:
            caches[dtype_name] = SegmentCachedEncoder(self._sp, dtype_name)
        return caches[dtype_name]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def _serialized(self) -> tuple[str, bytes]:
        return "spm", self._sp.serialized_model_proto()


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

    def _serialized(self) -> tuple[str, bytes] | None:
        # Our exports carry the sentencepiece model they were built from: the same fingerprint.
        model = Path(self.path) / "tokenizer.model"
        if model.is_file():
            import sentencepiece

            try:
                return "spm", sentencepiece.SentencePieceProcessor(
                    model_file=str(model)).serialized_model_proto()
            except (OSError, RuntimeError) as error:
                raise DataInputError(f"{model}: not a readable sentencepiece model ({error})") from None
        backend = getattr(self._tok, "backend_tokenizer", None)
        return None if backend is None else ("hf", backend.to_str().encode("utf-8"))
