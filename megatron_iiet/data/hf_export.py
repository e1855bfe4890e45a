"""Hugging Face tokenizer files for a sentencepiece model, encoding identically to it.

Built directly from the model's protobuf with the `tokenizers` library, so the mapping is explicit:

* vocabulary and ids are the sentencepiece pieces in id order;
* BPE merges are every split `(left, right)` of a normal piece whose halves are both pieces,
  ranked by the merged piece's score (sentencepiece applies the highest-scoring merge first);
* unigram keeps the pieces' log-probabilities as scores;
* byte fallback maps characters outside the vocabulary to `<0xNN>` pieces, like sentencepiece;
* the normalizer reproduces the model's normalizer spec (precompiled character map, extra
  whitespace removal, dummy prefix) followed by sentencepiece's space -> U+2581 escape; there is
  no pre-tokenizer (sentencepiece merges never cross a U+2581 anyway);
* control and unknown pieces are special tokens; `split_special_tokens` keeps their literal text
  (e.g. "</s>" inside a document) from being read as the token, as sentencepiece does;
* no BOS/EOS is added by `__call__`, matching `SentencePieceProcessor.encode`.

Known differences (none arise with this project's default training settings): with
`add_dummy_prefix` and user-defined symbols, HF prepends U+2581 after each user-defined symbol;
a unigram model's vocabulary matches literal control-token text such as "</s>" that
sentencepiece would spell out piece by piece, and on equal-score ties (e.g. a run of spaces
covered by the same whitespace pieces in another order) HF's Viterbi may order pieces
differently (same pieces, same decoded text). BPE, the default, encodes identically.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_iiet.data.atomic import write_bytes_atomic, write_json_atomic

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE_SYMBOL = "\u2581"


def _load_proto(model_path: str | os.PathLike):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_path).read_bytes())
    return proto


def _bpe_merges(proto) -> list[tuple[str, str]]:
    pieces = proto.pieces
    ids = {p.piece: i for i, p in enumerate(pieces)}
    mergeable = {p.piece for p in pieces if p.type in (_NORMAL, _USER_DEFINED)}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece_id, piece in enumerate(pieces):
        if piece.type != _NORMAL or len(piece.piece) < 2:
            continue
        text = piece.piece
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in mergeable and right in mergeable:
                # Higher score first; among splits of one piece, prefer lower ids (stable order).
                ranked.append((-piece.score, piece_id, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _normalizer(proto):
    from tokenizers import Regex, normalizers

    spec = proto.normalizer_spec
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps.append(normalizers.Strip(left=True, right=True))
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend(_SPACE_SYMBOL))
    steps.append(normalizers.Replace(" ", _SPACE_SYMBOL))
    return normalizers.Sequence(steps)


def _decoder(proto):
    from tokenizers import decoders

    steps = [decoders.Replace(_SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()]
    if proto.normalizer_spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def build_hf_tokenizer(model_path: str | os.PathLike):
    """A `tokenizers.Tokenizer` equivalent to the sentencepiece model at `model_path`."""
    from tokenizers import AddedToken, Tokenizer, models

    proto = _load_proto(model_path)
    trainer = proto.trainer_spec
    unk_piece = proto.pieces[trainer.unk_id].piece
    model_type = trainer.model_type  # 1 = unigram, 2 = bpe
    if model_type == 2:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        model = models.BPE(
            vocab=vocab,
            merges=_bpe_merges(proto),
            unk_token=unk_piece,
            byte_fallback=trainer.byte_fallback,
            fuse_unk=True,
        )
    elif model_type == 1:
        vocab = [(p.piece, p.score) for p in proto.pieces]
        model = models.Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    else:
        raise ValueError(f"{model_path}: sentencepiece model type {model_type} is not supported (bpe or unigram)")

    tokenizer = Tokenizer(model)
    tokenizer.normalizer = _normalizer(proto)
    tokenizer.decoder = _decoder(proto)
    specials = [
        AddedToken(p.piece, special=True, normalized=False)
        for p in proto.pieces
        if p.type in (_CONTROL, _UNKNOWN)
    ]
    user_defined = [
        AddedToken(p.piece, special=False, normalized=False)
        for p in proto.pieces
        if p.type == _USER_DEFINED
    ]
    tokenizer.add_special_tokens(specials)
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer, proto


def export_hf_tokenizer(model_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and a copy of the
    sentencepiece model into `out_dir` (each file written atomically). Returns `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, proto = build_hf_tokenizer(model_path)
    trainer = proto.trainer_spec

    def piece_or_none(index: int) -> str | None:
        return proto.pieces[index].piece if index >= 0 else None

    special = {
        "bos_token": piece_or_none(trainer.bos_id),
        "eos_token": piece_or_none(trainer.eos_id),
        "unk_token": piece_or_none(trainer.unk_id),
        "pad_token": piece_or_none(trainer.pad_id),
    }
    special = {key: value for key, value in special.items() if value is not None}
    write_bytes_atomic(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True).encode("utf-8"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000_000,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        **special,
    }
    write_json_atomic(out_dir / "tokenizer_config.json", config)
    write_json_atomic(out_dir / "special_tokens_map.json", special)
    model_copy = out_dir / "tokenizer.model"
    if Path(model_path).resolve() != model_copy.resolve():
        write_bytes_atomic(model_copy, Path(model_path).read_bytes())
    return out_dir
