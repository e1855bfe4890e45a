"""Exact, memoised sentencepiece BPE encoding: the fast path of preprocessing.

Sentencepiece BPE starts from single characters and merges two adjacent symbols only when their
concatenation is a piece of the vocabulary. If no piece holds `▁` right after another character,
no merge ever joins a character to a following space, so a text splits, before every run of
spaces that follows a non-space, into *segments* that encode independently: the ids of the text
are the ids of its segments, joined. Most segments are words seen before, so with the ids of
each segment memoised a document costs about a dict lookup per word instead of a BPE run
(~1 us per token).

Segments not seen yet are collected over a whole batch of documents and encoded by sentencepiece
in one call, several hundred to a string (`" key1 key2 ..."`, valid by the same independence);
the result is cut back into segments by the number of characters each token covers, and checked:
if a cut does not land on a segment boundary, the batch is encoded document by document instead.

The ids are byte-identical to per-document `sp.encode` (tested on prose, code and edge cases).
`cache_blocker` lists what a model must satisfy for this to hold; other models are encoded per
document. The cache is bounded and stops taking new segments when full (frequent words come
first), so a worker's memory is flat however long the input.
"""

from __future__ import annotations

import itertools
import operator
import re
from typing import Sequence

import numpy as np

_SPACE_KEYS = re.compile(r" ( *[^ ]*)")
DEFAULT_MAX_ENTRIES = 1 << 18  # ~160 bytes each (key, ids, dict slot): ~40 MB per worker


def cache_blocker(sp) -> str | None:
    """Why `SegmentCachedEncoder` would not reproduce `sp.encode` for this model, or None.

    Needed: a BPE model (merges only into vocabulary pieces); the normaliser the identity (no
    character map, no dummy prefix, no whitespace collapsing), with spaces escaped to `▁` and
    not treated as suffixes; byte fallback, so that a character outside the vocabulary is its
    own bytes and never a run-merged `<unk>`; no user-defined symbols (matched before BPE); and
    no piece with `▁` right after a non-`▁` character (the segment split).
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
    types = sentencepiece_model_pb2.ModelProto.SentencePiece
    for piece in model.pieces:
        if piece.type == types.USER_DEFINED:
            return "user-defined symbols"
        if re.search("[^\u2581]\u2581", piece.piece) and piece.type != types.BYTE:
            return f"piece {piece.piece!r} joins text across a space"
    return None


class _CutMismatch(Exception):
    """A token of the joined new segments spans two of them: the model breaks the assumption."""


class SegmentCachedEncoder:
    """`encode_batch(texts)`: each text's ids as bytes of `dtype_name`, as `sp.encode` gives."""

    MAX_KEY_CHARS = 32  # longer segments rarely repeat: not kept
    KEYS_PER_CALL = 256

    def __init__(self, sp, dtype_name: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.sp = sp
        self.max_entries = max_entries
        self.dtype = np.dtype(dtype_name)
        chars = np.zeros(sp.vocab_size(), dtype=np.int64)  # characters each token covers
        for token in range(sp.vocab_size()):
            if sp.is_byte(token):
                value = int(sp.id_to_piece(token)[1:-1], 16)
                chars[token] = 0 if 0x80 <= value < 0xC0 else 1  # continuation bytes add no character
            elif not (sp.is_control(token) or sp.is_unknown(token)):
                chars[token] = len(sp.id_to_piece(token))
        self.token_chars = chars
        self.cache: dict[str, bytes] = {}  # key -> bytes of sp.encode(" " + key)
        self.misses = 0  # new keys encoded (a key missing in several batches counts each time)

    def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
        splits = [_split(text) for text in texts]
        get = self.cache.get
        parts_of: list[list | None] = []
        missing: list[str] = []
        for split in splits:
            if split is None:
                parts_of.append(None)
                continue
            keys = split[1]
            parts = list(map(get, keys))
            if None in parts:
                missing.extend(itertools.compress(keys, map(operator.is_, parts, itertools.repeat(None))))
            parts_of.append(parts)
        missing = list(dict.fromkeys(missing))
        self.misses += len(missing)
        try:
            fresh = self._encode_keys(missing)
        except _CutMismatch:
            return [self._to_bytes(ids) for ids in self.sp.encode(list(texts), out_type=int, num_threads=1)]
        self._remember(fresh)
        heads = [split[0] for split in splits if split and split[0]]
        head_ids = iter(self._to_bytes_list(self.sp.encode(heads, out_type=int, num_threads=1)) if heads else [])
        out = []
        for text, split, parts in zip(texts, splits, parts_of):
            if split is None:
                out.append(self._to_bytes(self.sp.encode(text)))
                continue
            keys = split[1]
            if None in parts:
                for i in itertools.compress(itertools.count(), map(operator.is_, parts, itertools.repeat(None))):
                    parts[i] = fresh[keys[i]]
            if split[0]:
                parts.insert(0, next(head_ids))
            out.append(b"".join(parts))
        return out

    def _encode_keys(self, keys: list[str]) -> dict[str, bytes]:
        """{key: bytes of sp.encode(" " + key)}, encoded a few hundred keys to a string. Keys of
        only spaces (the end of a text) would merge with the next key's spaces: encoded alone."""
        has_text = list(map(str.strip, keys, itertools.repeat(" ")))
        if not all(has_text):
            blank = list(itertools.compress(keys, map(operator.not_, has_text)))
            keys = list(itertools.compress(keys, has_text))
            fresh = dict(zip(blank, self._to_bytes_list(self.sp.encode([" " + key for key in blank], out_type=int, num_threads=1))))
            return {**fresh, **self._encode_keys(keys)}
        if not keys:
            return {}
        strings = [" " + " ".join(keys[i:i + self.KEYS_PER_CALL]) for i in range(0, len(keys), self.KEYS_PER_CALL)]
        encoded = self.sp.encode(strings, out_type=int, num_threads=1)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        token_ends = np.cumsum(self.token_chars[ids])
        key_ends = np.cumsum(np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)) + 1)
        # A character outside the vocabulary is several byte tokens and only the first counts,
        # so a key ends at the last token not past its end ('right').
        cuts = np.searchsorted(token_ends, key_ends, side="right") - 1
        if cuts[-1] != len(ids) - 1 or not np.array_equal(token_ends[cuts], key_ends):
            raise _CutMismatch
        data = ids.astype(self.dtype).tobytes()
        offsets = ((cuts + 1) * self.dtype.itemsize).tolist()
        return dict(zip(keys, map(data.__getitem__, map(slice, [0] + offsets[:-1], offsets))))

    def _remember(self, fresh: dict[str, bytes]) -> None:
        """Add the short new keys while there is room; when full, the cache stays as it is."""
        room = self.max_entries - len(self.cache)
        if room > 0 and fresh:
            short = map(operator.ge, itertools.repeat(self.MAX_KEY_CHARS), map(len, fresh))
            self.cache.update(itertools.islice(itertools.compress(fresh.items(), short), room))

    def _to_bytes(self, ids) -> bytes:
        return np.asarray(ids, dtype=self.dtype).tobytes()

    def _to_bytes_list(self, encoded: list[list[int]]) -> list[bytes]:
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        data = np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype, count=int(lengths.sum())).tobytes()
        offsets = (np.concatenate(([0], np.cumsum(lengths))) * self.dtype.itemsize).tolist()
        return list(map(data.__getitem__, map(slice, offsets[:-1], offsets[1:])))


def _split(text: str) -> tuple[str, list[str]] | None:
    """(text before the first space, keys: each later segment without its first space), or None
    for a text with a literal `▁` (a space to sentencepiece: such texts are encoded whole)."""
    if "\u2581" in text:
        return None
    if "  " in text:
        first = text.find(" ")
        return (text if first < 0 else text[:first]), _SPACE_KEYS.findall(text)
    keys = text.split(" ")
    return keys.pop(0), keys
