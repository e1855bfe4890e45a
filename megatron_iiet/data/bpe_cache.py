"""Exact, memoised sentencepiece BPE encoding: the fast path of preprocessing.

Sentencepiece BPE starts from single characters and merges two adjacent symbols only when their
concatenation is a piece of the vocabulary. So where two adjacent characters a, b appear together
in no piece ("hard" pairs: a word and the space after it, a letter and a comma, ...), no merge
ever joins across them: a text cut at every hard pair gives *segments* that encode independently,
and the ids of the text are the ids of its segments, joined. Segments repeat (words, punctuation,
indentation), so with the ids of each segment memoised a document costs a table lookup per
segment instead of a BPE run (~1 us per token), and only segments never seen before go to
sentencepiece. Merge order does not matter: merges on either side of a hard pair never interact.

The cutting, the table and the joining run in C (`_segment_table.c`, built with the package; no
Python object per segment). The ids are byte-identical to per-document `sp.encode` (tested on prose,
code and edge cases). `cache_blocker` lists what a model must satisfy for this to hold; other
models, and installs where the C helper could not be compiled, are encoded per document. The table
is bounded and stops taking new segments when full (frequent ones come first), so a worker's
memory is flat however long the input.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

DEFAULT_MAX_ENTRIES = 1 << 20  # ~40 bytes each (key, ids, slots): ~40 MB per worker when full


def cache_blocker(sp) -> str | None:
    """Why `SegmentCachedEncoder` cannot reproduce `sp.encode` for this model here, or None.

    Needed: the C helper built; a BPE model (merges only into vocabulary pieces); the normaliser
    the identity (no character map, no dummy prefix, no whitespace collapsing) with spaces escaped
    to `▁`; byte fallback, so that a character outside the vocabulary is its own bytes and never a
    run-merged `<unk>`; and no user-defined symbols (matched before BPE, across hard pairs).
    """
    try:
        from megatron_iiet.data._segment_table import SegmentTable  # noqa: F401
    except ImportError as error:
        return f"the C segment table is not built ({error}; reinstall with a C compiler: pip install -e .)"
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
    if normalizer.precompiled_charsmap or normalizer.add_dummy_prefix or normalizer.remove_extra_whitespaces:
        return "the normaliser changes the text"
    if not normalizer.escape_whitespaces:
        return "whitespace is not escaped"
    if any(piece.type == sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED for piece in model.pieces):
        return "user-defined symbols"
    return None


def joinable_pairs(sp) -> np.ndarray:
    """(a, b) code points of every two adjacent characters in a vocabulary piece, `▁` read as a
    space (the C side reads a literal `▁` in the text as a space too). Byte pieces hold no text;
    control pieces never take part in merges, but listing them only ever cuts less."""
    pairs = set()
    for token in range(sp.vocab_size()):
        if sp.is_byte(token):
            continue
        piece = sp.id_to_piece(token).replace("\u2581", " ")
        pairs.update(zip(map(ord, piece), map(ord, piece[1:])))
    return np.array(sorted(pairs), dtype=np.uint32).reshape(-1, 2)


class SegmentCachedEncoder:
    """`encode_batch(texts)`: each text's ids as bytes of `dtype_name`, as `sp.encode` gives."""

    MAX_KEY_CHARS = 32  # longer segments rarely repeat: not kept

    def __init__(self, sp, dtype_name: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.sp = sp
        self.dtype = np.dtype(dtype_name)
        self._pairs = joinable_pairs(sp).tobytes()
        self.reset(max_entries)

    def reset(self, max_entries: int) -> None:
        """Empty the table and bound it at `max_entries` segments."""
        from megatron_iiet.data._segment_table import SegmentTable

        self.table = SegmentTable(self._pairs, max_entries, self.MAX_KEY_CHARS)
        self.misses = 0  # new segments encoded (one missing in several batches counts each time)

    def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
        missing = self.table.scan(texts)
        self.misses += len(missing)
        fresh = self._to_bytes_list(self.sp.encode(missing, out_type=int, num_threads=1)) if missing else []
        self.table.add(missing, fresh)
        return self.table.join(texts, fresh)

    def _to_bytes_list(self, encoded: list[list[int]]) -> list[bytes]:
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        data = np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype, count=int(lengths.sum())).tobytes()
        offsets = (np.concatenate(([0], np.cumsum(lengths))) * self.dtype.itemsize).tolist()
        return list(map(data.__getitem__, map(slice, offsets[:-1], offsets[1:])))
