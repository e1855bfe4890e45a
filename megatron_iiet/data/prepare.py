"""One call that gives the quickstart a tokenizer and a preprocessed dataset from the built-in
corpus, with no data argument and no download. Idempotent: finished outputs are reused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_iiet.data.corpus import BUILTIN_PREFIX, PYTHON_STDLIB
from megatron_iiet.data.preprocess import PreprocessConfig, run_preprocess
from megatron_iiet.data.tokenizer_training import INFO_FILE, MODEL_FILE, TokenizerTrainingConfig, train_tokenizer


@dataclass(frozen=True)
class PreparedData:
    tokenizer_model: str  # sentencepiece model
    tokenizer_dir: str  # the same tokenizer as HF files (AutoTokenizer.from_pretrained)
    data_prefix: str  # megatron indexed dataset prefix (.bin/.idx/.meta.json)
    fingerprint: str
    documents: int
    tokens: int


def prepare_builtin_corpus(
    out_dir: str,
    vocab_size: int = 4096,
    corpus_size: str = "4MB",
    workers: int = 1,
    progress: bool = False,
) -> PreparedData:
    """Train a BPE tokenizer on `builtin:python-stdlib:<corpus_size>` and preprocess that corpus.

    Layout under `out_dir`: `tokenizer/` (tokenizer.model + HF files) and
    `python_stdlib_text_document.{bin,idx,meta.json}`.
    """
    corpus = f"{BUILTIN_PREFIX}{PYTHON_STDLIB}:{corpus_size}"
    root = Path(out_dir)
    tokenizer_dir = root / "tokenizer"
    model_path = tokenizer_dir / MODEL_FILE
    # overwrite: a model left over from other settings is this function's own product, retrained on purpose
    training = TokenizerTrainingConfig(inputs=(corpus,), output_dir=str(tokenizer_dir), vocab_size=vocab_size, overwrite=True)
    info_path = tokenizer_dir / INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.exists() else None
    if info is None or info.get("config", {}).get("inputs") != [corpus] or info.get("vocab_size") != vocab_size or not model_path.exists():
        info = train_tokenizer(training)
    prefix = str(root / "python_stdlib_text_document")
    summary = run_preprocess(
        PreprocessConfig(inputs=(corpus,), tokenizer=str(model_path), output_prefix=prefix, workers=workers, progress=progress)
    )
    return PreparedData(str(model_path), str(tokenizer_dir), prefix, info["fingerprint"], summary.documents, summary.tokens)


def builtin_corpus(data, rank: int) -> Optional[tuple[str, str]]:
    """(tokenizer model, data prefix) of the built-in corpus for a run whose ``data`` section
    names no training data (None when it names some): rank 0 prepares it on first use, every
    rank then reads where it went. Called by the entry points (pretrain_iiet.py through
    megatron_iiet/run.py, the teacher-logit precompute), after the process group is up."""
    from megatron_iiet.distributed import barrier
    from megatron_iiet.errors import BadInput

    if data.train is not None:
        return None
    if data.tokenizer is not None:
        raise BadInput("data.tokenizer: set data.train too (the built-in corpus brings its own)")
    marker = Path(data.builtin_dir) / ".prepared"
    if rank == 0:
        prepared = prepare_builtin_corpus(data.builtin_dir, vocab_size=data.builtin_vocab_size,
                                          corpus_size=data.builtin_corpus_size)
        marker.write_text(prepared.data_prefix)
    barrier()
    return str(Path(data.builtin_dir) / "tokenizer" / MODEL_FILE), marker.read_text()
