"""Exact, memoised sentencepiece BPE encoding: the fast path of preprocessing.

`sp.encode(text)` is two steps: normalise the text (a character map such as NFKC, whitespace
collapsing, a dummy `▁` prefix, spaces escaped to `▁`), then run BPE on the normalised string and
turn its final symbols into ids. BPE starts from single characters and merges two adjacent symbols
only when their concatenation is a piece of the vocabulary. So where two adjacent characters a, b
appear together in no piece ("hard" pairs: a word and the `▁` after it, a letter and a comma, ...),
no merge ever joins across them: a normalised text cut at every hard pair gives *segments* that
encode independently, and the ids of the text are the ids of its segments, joined. Merge order does
not matter: merges on either side of a hard pair never interact, and on each side they come in the
same order (score, then position) as when that side is encoded alone.

One step after BPE looks across symbols: without byte fallback, sentencepiece turns a run of
adjacent unknown symbols into a single `<unk>`. A final symbol can only be unknown when it is a
single character that is not a piece itself (merged symbols are pieces), so the text is never cut
between two such characters, and a cut with a known character on either side cannot split a run.
With byte fallback every unknown character becomes its own bytes, and nothing looks across.

So: each text is normalised once (with sentencepiece's own normaliser, or not at all when it is the
identity with at most a dummy prefix), cut in C (`_segment_table.c`, built with the package; no
Python object per segment), every segment looked up in a table of segments already encoded, and only
segments never seen before go to sentencepiece, one call per batch, through a *twin* of the model:
the same pieces and trainer spec with the identity normaliser, no dummy prefix and no whitespace
removal, so that an already normalised segment is encoded as it stands. Segments repeat (words,
punctuation, indentation), so a document costs a table lookup per segment instead of a BPE run
(~1 us per token). The table is bounded and stops taking new segments when full (frequent ones come
first), so a worker's memory is flat however long the input.

The ids are byte-identical to per-document `sp.encode` (tested on prose, code, random Unicode and
edge cases, for spm_train's defaults, Llama-style and this project's own settings). `cache_blocker`
says which models this does not hold for (unigram and other non-BPE models, user-defined symbols,
unescaped whitespace) and when the C helper is missing; those are encoded per document.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

DEFAULT_MAX_ENTRIES = 1 << 20  # ~40 bytes each (key, ids, slots): ~40 MB per worker when full
_SPACE = "\u2581"


def _model_proto(sp):
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(sp.serialized_model_proto())
    return model


def cache_blocker(sp) -> str | None:
    """Why `SegmentCachedEncoder` cannot reproduce `sp.encode` for this model here, or None.

    Needed: the C helper built; a BPE model (merges only into vocabulary pieces); no user-defined
    symbols (matched as a whole before BPE, across hard pairs); whitespace escaped to `▁` (the cut
    reads `▁` and a space as one character). Everything else is reproduced: any normaliser (the
    text is normalised first, with sentencepiece's own normaliser), dummy prefix or suffix,
    whitespace collapsing, byte fallback or none (runs of unknown characters are kept whole),
    split_digits, split_by_whitespace, whitespace-only pieces, unused pieces.
    """
    try:
        from megatron_iiet.data._segment_table import SegmentTable  # noqa: F401
    except ImportError as error:
        return f"the C segment table is not built ({error}; reinstall with a C compiler: pip install -e .)"
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: cannot inspect the model, so do not assume
        return "sentencepiece_model_pb2 (protobuf) is not importable"
    model = _model_proto(sp)
    trainer, normalizer = model.trainer_spec, model.normalizer_spec
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type).lower()
        return f"a {kind} model (the cache reproduces BPE merges only)"
    if any(piece.type == sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED for piece in model.pieces):
        return "user-defined symbols (matched whole before BPE, across the segment cuts)"
    if not normalizer.escape_whitespaces:
        return "whitespace is not escaped to \u2581 (escape_whitespaces=false)"
    if _normaliser(sp, model) is None:
        return "this sentencepiece has no SentencePieceProcessor.normalize to normalise the text first"
    return None


def _normaliser(sp, model) -> Callable[[list[str]], list[str]] | None:
    """texts -> the texts as sentencepiece's normaliser gives them to BPE, up to the escaping of
    spaces (the twin escapes them; the cut reads a space and `▁` alike). None: not available."""
    normalizer, trainer = model.normalizer_spec, model.trainer_spec
    if not normalizer.precompiled_charsmap and not normalizer.remove_extra_whitespaces:
        if not normalizer.add_dummy_prefix:
            return lambda texts: texts  # the identity: nothing to do
        # The identity with a dummy `▁`: added to every non-empty text, before it, or after it
        # with treat_whitespace_as_suffix. Cheaper than a call into sentencepiece per text.
        if trainer.treat_whitespace_as_suffix:
            return lambda texts: [text + " " if text else text for text in texts]
        return lambda texts: [" " + text if text else text for text in texts]
    normalize = getattr(sp, "normalize", None)
    if normalize is None:
        return None

    def normalise(texts: Sequence[str]) -> list[str]:
        try:
            return normalize(list(texts))
        except (RuntimeError, TypeError):
            raise_if_unencodable(texts)
            raise

    return normalise


def raise_if_unencodable(texts: Sequence[str]) -> None:
    """Raise the UnicodeEncodeError of the first text that is not valid Unicode (a lone surrogate,
    which JSON can spell): sentencepiece's bindings reject such a text with a bare RuntimeError or TypeError,
    while the C table, like `str.encode`, raises UnicodeEncodeError, which preprocessing turns into
    an error naming the file and line."""
    for text in texts:
        text.encode("utf-8")


def segment_processor(sp, model=None):
    """The twin of `sp`: same pieces, scores and trainer spec, but the identity normaliser with no
    dummy prefix and no whitespace removal, so it encodes a normalised segment as it stands.
    `sp` itself when its normaliser already is that."""
    import sentencepiece

    model = model if model is not None else _model_proto(sp)
    normalizer = model.normalizer_spec
    if not (normalizer.precompiled_charsmap or normalizer.add_dummy_prefix or normalizer.remove_extra_whitespaces):
        return sp
    normalizer.name = "identity"
    normalizer.precompiled_charsmap = b""
    normalizer.normalization_rule_tsv = ""
    normalizer.add_dummy_prefix = False
    normalizer.remove_extra_whitespaces = False
    return sentencepiece.SentencePieceProcessor(model_proto=model.SerializeToString())


def _text_pieces(model) -> list[str]:
    """Every piece that holds text (all but byte pieces), `▁` read as a space."""
    from sentencepiece import sentencepiece_model_pb2

    byte = sentencepiece_model_pb2.ModelProto.SentencePiece.BYTE
    return [piece.piece.replace(_SPACE, " ") for piece in model.pieces if piece.type != byte]


def joinable_pairs(sp, model=None) -> np.ndarray:
    """(a, b) code points of every two adjacent characters in a vocabulary piece, `▁` read as a
    space (the C side reads a literal `▁` in the text as a space too). Byte pieces hold no text;
    control pieces never take part in merges, but listing them only ever cuts less."""
    pairs = set()
    for piece in _text_pieces(model if model is not None else _model_proto(sp)):
        pairs.update(zip(piece, piece[1:]))
    return np.array(sorted((ord(a), ord(b)) for a, b in pairs), dtype=np.uint32).reshape(-1, 2)


def known_chars(sp, model=None) -> np.ndarray:
    """Code points of the characters that are vocabulary pieces themselves (`▁` as a space): the
    only characters that never come out of BPE as an unknown symbol of their own."""
    unk = sp.unk_id()
    chars = {piece for piece in _text_pieces(model if model is not None else _model_proto(sp)) if len(piece) == 1}
    return np.array(sorted(ord(c) for c in chars if sp.piece_to_id(c if c != " " else _SPACE) != unk), dtype=np.uint32)


class SegmentCachedEncoder:
    """`encode_batch(texts)`: each text's ids as bytes of `dtype_name`, as `sp.encode` gives."""

    MAX_KEY_CHARS = 32  # longer segments rarely repeat: not kept

    def __init__(self, sp, dtype_name: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        blocker = cache_blocker(sp)
        if blocker is not None:
            raise ValueError(f"the segment cache cannot reproduce this model: {blocker}")
        model = _model_proto(sp)
        self.sp = sp
        self.dtype = np.dtype(dtype_name)
        self._normalise = _normaliser(sp, model)
        self._pairs = joinable_pairs(sp, model).tobytes()
        # Without byte fallback, runs of characters outside the vocabulary must not be cut.
        self._known = None if model.trainer_spec.byte_fallback else known_chars(sp, model).tobytes()
        self._segment_sp = segment_processor(sp, model)  # last: it edits `model`
        self.reset(max_entries)

    def reset(self, max_entries: int) -> None:
        """Empty the table and bound it at `max_entries` segments."""
        from megatron_iiet.data._segment_table import SegmentTable

        self.table = SegmentTable(self._pairs, max_entries, self.MAX_KEY_CHARS, self._known)
        self.misses = 0  # new segments encoded (one missing in several batches counts each time)

    def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
        texts = self._normalise(texts)
        missing = self.table.scan(texts)
        self.misses += len(missing)
        fresh = self._to_bytes_list(self._segment_sp.encode(missing, out_type=int, num_threads=1)) if missing else []
        self.table.add(missing, fresh)
        return self.table.join(texts, fresh)

    def _to_bytes_list(self, encoded: list[list[int]]) -> list[bytes]:
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        data = np.fromiter(itertools.chain.from_iterable(encoded), dtype=self.dtype, count=int(lengths.sum())).tobytes()
        offsets = (np.concatenate(([0], np.cumsum(lengths))) * self.dtype.itemsize).tolist()
        return list(map(data.__getitem__, map(slice, offsets[:-1], offsets[1:])))
