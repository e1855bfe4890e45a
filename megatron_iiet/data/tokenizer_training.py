"""Train a sentencepiece tokenizer from the same inputs `preprocess` reads, and write the Hugging
Face files for the same vocabulary next to it.

Defaults suit a code+prose pretraining corpus: identity normalization and no whitespace collapsing
(indentation and line breaks survive a round trip), byte fallback (no unknown tokens), digits
split. Documents are fed to the trainer in chunks of whole lines; `input_sentence_size` makes
sentencepiece keep a uniform random sample of that many chunks, bounding memory on big inputs.
"""

from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from megatron_iiet.data.atomic import write_bytes_atomic, write_json_atomic, writing_to
from megatron_iiet.data.errors import DataInputError
from megatron_iiet.data.hf_export import export_hf_tokenizer
from megatron_iiet.data.inputs import ReaderConfig, iter_documents, resolve_inputs
from megatron_iiet.locks import exclusive_output

MODEL_FILE = "tokenizer.model"
INFO_FILE = "tokenizer_info.json"


@dataclass(frozen=True)
class TokenizerTrainingConfig:
    inputs: tuple[str, ...]
    output_dir: str
    model_type: str = "bpe"  # or "unigram"
    vocab_size: int = 32000
    byte_fallback: bool = True
    character_coverage: float = 0.9995
    user_defined_symbols: tuple[str, ...] = ()
    control_symbols: tuple[str, ...] = ()
    input_sentence_size: int = 1_000_000  # chunks sampled for training; 0 = use all
    normalization: str = "identity"  # or nmt_nfkc, nfkc, ...
    add_dummy_prefix: bool = False
    split_digits: bool = True
    chunk_chars: int = 4096
    text_key: str = "text"
    text_unit: str = "document"
    strip: str | None = None  # input cleaning (corpus.clean_text), e.g. "gutenberg"
    threads: int = os.cpu_count() or 1
    overwrite: bool = False  # replace an existing tokenizer.model (data made with it no longer matches)


def _chunks(text: str, limit: int) -> Iterator[str]:
    """Split a document into pieces of at most `limit` chars at line ends where possible."""
    buffer: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        while len(line) > limit:  # one very long line: hard cuts
            if buffer:
                yield "".join(buffer)
                buffer, size = [], 0
            yield line[:limit]
            line = line[limit:]
        if size + len(line) > limit and buffer:
            yield "".join(buffer)
            buffer, size = [], 0
        buffer.append(line)
        size += len(line)
    if buffer:
        yield "".join(buffer)


def _sentences(config: TokenizerTrainingConfig) -> Iterator[str]:
    files = resolve_inputs(list(config.inputs))
    reader = ReaderConfig(text_key=config.text_key, text_unit=config.text_unit, strip=config.strip)
    for document in iter_documents(files, reader):
        if document.text:
            yield from _chunks(document.text, config.chunk_chars)


def train_tokenizer(config: TokenizerTrainingConfig) -> dict:
    """Train; write tokenizer.model, the HF tokenizer files and tokenizer_info.json into
    `output_dir`. Returns the info dict (paths, fingerprint, settings).

    An existing tokenizer.model is kept (refused) unless `overwrite`; a second training into the
    same directory at the same time refuses (lock on tokenizer.model); an unwritable or full
    directory gives one OutputWriteError, found before the training work where it can be."""
    if config.model_type not in ("bpe", "unigram"):
        raise DataInputError(f"--model-type {config.model_type!r}: choose bpe or unigram")
    inputs = resolve_inputs(list(config.inputs))  # fail on bad paths before any training work
    out_dir = Path(config.output_dir)
    model_path = out_dir / MODEL_FILE
    with writing_to(out_dir, reading=[f.path for f in inputs]):
        out_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_output(model_path, "another tokenizer training", "wait for it to finish or choose another --output-dir"):
            if model_path.exists() and not config.overwrite:
                raise DataInputError(f"{model_path}: already exists (data preprocessed with it would no longer match); "
                                     "choose another --output-dir or pass --overwrite")
            return _train_and_write(config, out_dir, model_path)


def _train_and_write(config: TokenizerTrainingConfig, out_dir: Path, model_path: Path) -> dict:
    import sentencepiece

    from megatron_iiet.data.tokenizer import Tokenizer

    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_sentences(config),
            model_writer=model,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            byte_fallback=config.byte_fallback,
            character_coverage=config.character_coverage,
            user_defined_symbols=list(config.user_defined_symbols),
            control_symbols=list(config.control_symbols),
            input_sentence_size=config.input_sentence_size,
            shuffle_input_sentence=True,
            normalization_rule_name=config.normalization,
            remove_extra_whitespaces=False,
            add_dummy_prefix=config.add_dummy_prefix,
            split_digits=config.split_digits,
            allow_whitespace_only_pieces=True,
            max_sentence_length=4 * config.chunk_chars + 16,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            num_threads=config.threads,
            minloglevel=2,
        )
    except RuntimeError as error:
        raise DataInputError(f"sentencepiece training failed: {error}") from None
    write_bytes_atomic(model_path, model.getvalue())
    export_hf_tokenizer(model_path, out_dir)
    tokenizer = Tokenizer.from_path(model_path)
    info = {
        "model": str(model_path),
        "hf_dir": str(out_dir),
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "eod_id": tokenizer.eod_id,
        "pad_id": tokenizer.pad_id,
        "config": asdict(config),
    }
    write_json_atomic(out_dir / INFO_FILE, info)
    return info
