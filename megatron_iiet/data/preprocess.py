"""Streaming, sharded, resumable preprocessing of raw text into megatron-core indexed datasets.

Pipeline: the main process reads documents one file at a time (HF datasets, streaming; plain
.jsonl lines are passed on unparsed), groups them into batches and hands them to worker processes
that parse, tokenize and append EOD; results come back in order and are written straight to the
current shard. At most `2 * workers + 2` batches
are in flight, so memory is bounded by the batch size, not by the input (unlike a pool `imap`,
which reads its whole input ahead).

Shards (`--shard-size` tokens) close after the document that fills them, so shard boundaries
depend only on the input and tokenizer. Each finished shard records where in the input it ended;
a re-run with the same arguments keeps the finished shards, discards a half-written one and
continues from there, giving the same bytes as an uninterrupted run.

Faults: a run holds an exclusive lock on its output prefix (`PREFIX.lock`) from before it looks at
any output until it ends, so a second run to the same prefix refuses at once and touches nothing.
The run's arguments, including each input's size and mtime, are recorded with every output; an
input edited since is therefore noticed, never silently mixed with the old output. Workers die
with the main process, even when it is killed with SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from megatron_iiet.data import indexed_io
from megatron_iiet.data.atomic import temp_leftovers, writing_to
from megatron_iiet.data.bpe_cache import DEFAULT_MAX_ENTRIES
from megatron_iiet.data.errors import DataInputError, TokenizerMismatchError
from megatron_iiet.data.inputs import (TEXT_UNITS, Document, JsonLine, ReaderConfig, inputs_signature, iter_documents,
                                       parse_json_line, record_word, resolve_inputs)
from megatron_iiet.lifetime import signal_on_parent_death
from megatron_iiet.locks import exclusive_output
from megatron_iiet.data.tokenizer import (Tokenizer, check_dtype_fits, fingerprint_matches,
                                          smallest_token_dtype)


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    tokenizer: str
    output_prefix: str
    text_key: str = "text"
    text_unit: str = "document"
    workers: int = 1  # 0 tokenizes in the main process
    shard_size: int | None = None  # tokens per shard; None writes one dataset
    merge: bool = False  # after sharding, merge all shards into `output_prefix`
    keep_shards: bool = False  # keep the shards after a merge
    dtype: str | None = None  # None: smallest dtype that holds the vocabulary
    append_eod: bool = True
    batch_documents: int = 512
    batch_chars: int = 1 << 20  # also close a batch at this much text, whatever the count
    # Segments whose sentencepiece BPE ids each worker memoises (byte-identical output; models where
    # that cannot be guaranteed are encoded per document, said once on stderr); 0: none, silently.
    segment_cache_entries: int = DEFAULT_MAX_ENTRIES
    hf_reader: bool = False  # read .jsonl/.txt through HF datasets too (default: a direct reader)
    strip: str | None = None  # input cleaning (corpus.clean_text), e.g. "gutenberg"
    overwrite: bool = False  # replace output of a run with different arguments
    progress: bool = True


@dataclass
class PreprocessSummary:
    documents: int = 0  # written
    tokens: int = 0
    empty_documents: int = 0  # "" texts, not written
    skipped_documents: int = 0  # null texts, not written
    input_bytes: int = 0  # UTF-8 bytes of text tokenized in this run
    seconds: float = 0.0
    resumed_shards: int = 0
    outputs: list[str] = field(default_factory=list)
    already_complete: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


# ---- worker side -------------------------------------------------------------------------------
_WORKER_TOKENIZER: Tokenizer | None = None
_WORKER_DTYPE: str = "int32"
_WORKER_EOD: int | None = None
_WORKER_SEGMENT_CACHE = True
_WORKER_TEXT_KEY = "text"
# What became of each document of a batch: written, or not written because empty / null.
WRITTEN, EMPTY, NULL = 0, 1, 2


_PARENT_POLL_SECONDS = 1.0


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)


def _exit_with_parent(parent_pid: int) -> None:
    """Make this worker die with the main process. A main process killed by SIGKILL runs no
    cleanup, so nothing else would stop its workers: they would tokenize on as orphans."""
    # The pool starts its workers from the submitting thread, the main one, which lives as long
    # as the process (megatron_iiet.lifetime).
    if signal_on_parent_death(signal.SIGKILL, parent_pid):
        return
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="watch-parent", daemon=True).start()


def _init_worker(tokenizer_path: str, dtype_name: str, eod_id: int | None, segment_cache_entries: int, text_key: str,
                 parent_pid: int | None = None) -> None:
    global _WORKER_TOKENIZER, _WORKER_DTYPE, _WORKER_EOD, _WORKER_SEGMENT_CACHE, _WORKER_TEXT_KEY
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    _WORKER_TEXT_KEY = text_key
    _WORKER_TOKENIZER = Tokenizer.from_path(tokenizer_path)
    _WORKER_DTYPE, _WORKER_EOD, _WORKER_SEGMENT_CACHE = dtype_name, eod_id, segment_cache_entries > 0
    encoder = _WORKER_TOKENIZER.segment_cache(dtype_name) if segment_cache_entries > 0 else None
    if encoder is not None:
        encoder.reset(segment_cache_entries)


def _document_text(item: str | None | JsonLine, text_key: str) -> str | None:
    return parse_json_line(item, text_key) if isinstance(item, JsonLine) else item


def _tokenize_batch(items: list[str | None | JsonLine]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Tokens of the non-empty texts (each followed by EOD) flattened, every document's token
    count (0 for empty/null texts, which are dropped), what became of each (WRITTEN / EMPTY /
    NULL) and the UTF-8 bytes read. Unparsed jsonl lines are parsed here, in the worker."""
    texts = [_document_text(item, _WORKER_TEXT_KEY) for item in items]
    kinds = np.array([WRITTEN if text else NULL if text is None else EMPTY for text in texts], dtype=np.int8)
    flat, kept_lengths = _WORKER_TOKENIZER.encode_to_arrays(
        [text for text in texts if text], _WORKER_DTYPE, _WORKER_EOD, cache_segments=_WORKER_SEGMENT_CACHE
    )
    lengths = np.zeros(len(texts), dtype=np.int64)
    lengths[kinds == WRITTEN] = kept_lengths
    read_bytes = sum(len(text.encode("utf-8")) for text in texts if text)
    return flat, lengths, kinds, read_bytes


# ---- main side -----------------------------------------------------------------------------------
def shard_prefix(output_prefix: str, index: int) -> str:
    return f"{output_prefix}_shard{index:05d}"


def _run_signature(config: PreprocessConfig, files, tokenizer: Tokenizer, dtype_name: str) -> dict:
    return {
        "inputs": inputs_signature(files),
        "text_key": config.text_key,
        "text_unit": config.text_unit,
        "append_eod": config.append_eod,
        "shard_size": config.shard_size,
        "dtype": dtype_name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        **({"strip": config.strip} if config.strip else {}),  # absent: as runs recorded before
    }


def _same_run(recorded: dict | None, signature: dict) -> bool:
    if recorded == signature:
        return True
    if isinstance(recorded, dict) and fingerprint_matches(recorded.get("tokenizer_fingerprint"),
                                                          signature["tokenizer_fingerprint"]):
        # a record of the legacy fingerprint (before it hashed the whole model): the same tokenizer
        recorded = {**recorded, "tokenizer_fingerprint": signature["tokenizer_fingerprint"]}
        if recorded == signature:
            return True
    # Records written before input mtimes were kept hold [path, size] per input: compare those.
    inputs = recorded.get("inputs") if isinstance(recorded, dict) else None
    if inputs and all(isinstance(entry, list) and len(entry) == 2 for entry in inputs):
        return recorded == {**signature, "inputs": [entry[:2] for entry in signature["inputs"]]}
    return False


def _describe_difference(recorded: dict, signature: dict) -> str:
    changed = sorted(k for k in signature if recorded.get(k) != signature[k])
    if "inputs" in changed:
        before = {entry[0]: entry[1:] for entry in recorded.get("inputs") or []}
        edited = [path for path, *now in signature["inputs"] if path in before and before[path] != now]
        if edited:
            detail = f"inputs: {edited[0]} was modified since (size or modification time)"
            changed[changed.index("inputs")] = detail + (f" and {len(edited) - 1} more" if len(edited) > 1 else "")
    return ", ".join(changed) or "format"


def _check_output_prefix(output_prefix: str) -> None:
    """A prefix that names a directory would write hidden files `DIR/.bin`, `DIR/.idx`."""
    path = Path(output_prefix)
    if output_prefix.endswith(("/", os.sep)) or path.is_dir() or path.name in ("", ".", ".."):
        example = Path(output_prefix) / "corpus"
        raise DataInputError(f"--output-prefix {output_prefix}: names a directory, not a file name prefix; "
                             f"give e.g. {example} (writes {example}.bin, .idx, .meta.json)")


def _check_output_directory(config: PreprocessConfig, tokenizer: Tokenizer, signature: dict) -> None:
    """Refuse a directory holding another tokenizer's data, or this prefix from another run."""
    prefix = Path(config.output_prefix)
    directory = prefix.parent
    if not directory.is_dir():
        return
    for meta_file in sorted(directory.glob("*.meta.json")):
        try:
            meta = indexed_io.read_meta(str(meta_file)[: -len(".meta.json")])
        except ValueError:
            continue  # not one of ours; leave it alone
        fingerprint = meta.get("tokenizer", {}).get("fingerprint")
        if not fingerprint_matches(fingerprint, tokenizer.fingerprint):
            raise TokenizerMismatchError(
                f"{meta_file}: output directory {directory} already holds data made with another tokenizer "
                f"({fingerprint} vs {tokenizer.fingerprint}); use another output directory"
            )
        belongs_here = meta_file.name.startswith(prefix.name + ".") or meta_file.name.startswith(prefix.name + "_shard")
        if belongs_here and not _same_run(meta.get("run"), signature) and not config.overwrite:
            raise DataInputError(
                f"{meta_file}: {prefix} holds output of a run with different arguments (differs in: "
                f"{_describe_difference(meta.get('run') or {}, signature)}); choose another --output-prefix or pass --overwrite"
            )


def _remove_prefix_outputs(output_prefix: str) -> None:
    indexed_io.remove_dataset(output_prefix)
    prefix = Path(output_prefix)
    for path in prefix.parent.glob(prefix.name + "_shard*"):
        path.unlink()


def _finished_shards(config: PreprocessConfig, signature: dict) -> list[dict]:
    """Metas of the leading run of complete, intact shards; later shard files are removed."""
    finished: list[dict] = []
    index = 0
    while True:
        prefix = shard_prefix(config.output_prefix, index)
        if not indexed_io.meta_path(prefix).exists():
            break
        try:
            indexed_io.verify_dataset(prefix)
            meta = indexed_io.read_meta(prefix)
        except ValueError:
            break
        if not _same_run(meta.get("run"), signature):
            break
        finished.append(meta)
        index += 1
    # Whatever follows (a shard cut off by a kill, or stale later shards) is redone.
    stale_index = index
    while any(p.exists() or temp_leftovers(p) for p in indexed_io.dataset_files(shard_prefix(config.output_prefix, stale_index))):
        indexed_io.remove_dataset(shard_prefix(config.output_prefix, stale_index))
        stale_index += 1
    indexed_io.remove_dataset(shard_prefix(config.output_prefix, index))
    return finished


def _batches(documents: Iterator[Document], config: PreprocessConfig):
    batch: list[Document] = []
    chars = 0
    for document in documents:
        batch.append(document)
        text = document.text
        chars += len(text.raw if isinstance(text, JsonLine) else text or "")
        if len(batch) >= config.batch_documents or chars >= config.batch_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _unencodable_text_error(batch: list[Document], files, text_key: str) -> DataInputError | None:
    """The document of `batch` that is not valid Unicode (JSON can spell a lone surrogate,
    `"\\ud800"`, which no tokenizer can encode), as an error naming its file and line."""
    for document in batch:
        try:
            (_document_text(document.text, text_key) or "").encode("utf-8")
        except UnicodeEncodeError as error:
            input_file = files[document.file_index]
            where = (f"line {document.text.line}" if isinstance(document.text, JsonLine)
                     else f"{record_word(input_file.builder)} {document.row + 1}")
            return DataInputError(f"{input_file.path}: {where}: text is not valid Unicode "
                                  f"({error.reason}: {error.object[error.start:error.end]!r} at character {error.start})")
    return None


class _OrderedTokenizer:
    """Tokenize batches in worker processes, results in input order, bounded read-ahead."""

    def __init__(self, config: PreprocessConfig, dtype_name: str, eod_id: int | None, files) -> None:
        self.files = files
        self.workers = config.workers
        self.text_key = config.text_key
        init_args = (config.tokenizer, dtype_name, eod_id, config.segment_cache_entries, config.text_key)
        if self.workers > 0:
            # spawn: no fork of a process holding arrow threads. An executor (not a Pool) so a
            # worker that dies raises BrokenProcessPool instead of hanging the run.
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_init_worker,
                                            initargs=(*init_args, os.getpid()))
        else:
            self.pool = None
            _init_worker(*init_args)

    def map(self, batches):
        if self.pool is None:
            for batch in batches:
                yield batch, self._checked(batch, lambda: _tokenize_batch([d.text for d in batch]))
            return
        pending: deque = deque()
        limit = 2 * self.workers + 2
        for batch in batches:
            pending.append((batch, self.pool.submit(_tokenize_batch, [d.text for d in batch])))
            if len(pending) >= limit:
                done_batch, result = pending.popleft()
                yield done_batch, self._checked(done_batch, result.result)
        while pending:
            done_batch, result = pending.popleft()
            yield done_batch, self._checked(done_batch, result.result)

    def _checked(self, batch, tokenize):
        try:
            return tokenize()
        except UnicodeEncodeError:
            error = _unencodable_text_error(batch, self.files, self.text_key)
            if error is None:
                raise
            raise error from None

    def close(self, terminate: bool = False) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=not terminate, cancel_futures=terminate)


def _progress_bar(config: PreprocessConfig, total_bytes: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                desc="preprocess", disable=not config.progress, dynamic_ncols=True, smoothing=0.1)


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Preprocess `config.inputs` into indexed dataset(s); see the module docstring."""
    started = time.perf_counter()
    _check_output_prefix(config.output_prefix)
    if config.text_unit not in TEXT_UNITS:
        raise DataInputError(f"--text-unit {config.text_unit!r}: choose one of {', '.join(TEXT_UNITS)}")
    if config.segment_cache_entries < 0:
        raise DataInputError(f"--segment-cache-entries must be >= 0 (0 turns the cache off), got {config.segment_cache_entries}")
    if config.shard_size is not None and config.shard_size <= 0:
        raise DataInputError(f"--shard-size must be positive, got {config.shard_size}")
    tokenizer = Tokenizer.from_path(config.tokenizer)
    files = resolve_inputs(list(config.inputs))
    dtype = np.dtype(config.dtype).type if config.dtype else smallest_token_dtype(tokenizer.vocab_size)
    check_dtype_fits(tokenizer.vocab_size, dtype, config.tokenizer)
    dtype_name = np.dtype(dtype).name
    if dtype_name not in indexed_io.DTYPE_CODES:
        raise DataInputError(f"--dtype {dtype_name}: not storable in an indexed dataset")
    eod_id = tokenizer.eod_id if config.append_eod else None
    if config.append_eod and eod_id is None:
        raise DataInputError(f"{config.tokenizer}: tokenizer has no EOS/EOD token; pass --no-eod or use another tokenizer")
    signature = _run_signature(config, files, tokenizer, dtype_name)
    with writing_to(Path(config.output_prefix).parent, reading=[f.path for f in files]), exclusive_output(
            config.output_prefix, "another preprocessing run",
            "wait for it to finish or choose another --output-prefix"):
        return _run_locked(config, started, tokenizer, files, dtype, eod_id, signature)


def _say_if_segment_cache_off(config: PreprocessConfig, tokenizer: Tokenizer) -> None:
    """One line on stderr, once per run, when the fast path is off though not turned off by the
    user (`segment_cache_entries=0`, `--no-segment-cache`): the run is then several times slower."""
    if config.segment_cache_entries > 0 and tokenizer.segment_cache_blocker is not None:
        print(f"preprocess: segment cache off for tokenizer {config.tokenizer}: {tokenizer.segment_cache_blocker}; "
              "encoding per document", file=sys.stderr, flush=True)


def _run_locked(config: PreprocessConfig, started: float, tokenizer: Tokenizer, files, dtype, eod_id: int | None,
                signature: dict) -> PreprocessSummary:
    dtype_name = np.dtype(dtype).name
    _check_output_directory(config, tokenizer, signature)
    summary = PreprocessSummary()
    final_prefix = config.output_prefix
    sharded = config.shard_size is not None
    if config.overwrite:
        _remove_prefix_outputs(config.output_prefix)
    if (not sharded or config.merge) and indexed_io.meta_path(final_prefix).exists():
        meta = indexed_io.read_meta(final_prefix)
        if _same_run(meta.get("run"), signature):
            indexed_io.verify_dataset(final_prefix)
            summary.already_complete = True
            summary.documents, summary.tokens = meta["documents"], meta["tokens"]
            summary.outputs = [final_prefix]
            summary.seconds = time.perf_counter() - started
            return summary

    finished = _finished_shards(config, signature) if sharded else []
    if not sharded:
        indexed_io.remove_dataset(final_prefix)  # leftovers of an interrupted unsharded run
    start_file, start_row = (finished[-1]["input_end"] if finished else (0, 0))
    for meta in finished:
        summary.documents += meta["documents"]
        summary.tokens += meta["tokens"]
        summary.empty_documents += meta["stats"]["empty_documents"]
        summary.skipped_documents += meta["stats"]["skipped_documents"]
    summary.resumed_shards = len(finished)
    shard_index = len(finished)
    outputs = [shard_prefix(config.output_prefix, i) for i in range(shard_index)]
    meta_common = {"tokenizer": tokenizer.describe(), "run": signature}

    def open_writer():
        prefix = shard_prefix(config.output_prefix, shard_index) if sharded else final_prefix
        return indexed_io.IndexedDatasetWriter(prefix, dtype)

    reader_config = ReaderConfig(text_key=config.text_key, text_unit=config.text_unit, hf_reader=config.hf_reader,
                                 defer_json=config.strip is None, strip=config.strip)
    documents = iter_documents(files, reader_config, start_file, start_row)
    _say_if_segment_cache_off(config, tokenizer)
    engine = _OrderedTokenizer(config, dtype_name, eod_id, files)
    bar = _progress_bar(config, sum(f.size for f in files), sum(f.size for f in files[:start_file]))
    writer = open_writer()
    shard_stats = {"empty_documents": 0, "skipped_documents": 0}
    run_docs = run_tokens = 0
    try:
        for batch, (flat, lengths, kinds, read_bytes) in engine.map(_batches(documents, config)):
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            first = 0
            while first < len(batch):
                last = len(batch)
                if sharded:
                    room = config.shard_size - writer.tokens
                    filled = np.nonzero(offsets[first + 1:] - offsets[first] >= room)[0]
                    if filled.size:
                        last = first + int(filled[0]) + 1  # the document that fills the shard
                kept = lengths[first:last] > 0
                writer.add_documents(flat[offsets[first]:offsets[last]], lengths[first:last][kept])
                shard_stats["skipped_documents"] += int((kinds[first:last] == NULL).sum())
                shard_stats["empty_documents"] += int((kinds[first:last] == EMPTY).sum())
                if sharded and writer.tokens >= config.shard_size:
                    end = batch[last - 1]
                    outputs.append(writer.prefix)
                    summary.documents += writer.documents
                    summary.tokens += writer.tokens
                    writer.finalize({**meta_common, "input_end": [end.file_index, end.row + 1], "stats": dict(shard_stats)})
                    summary.empty_documents += shard_stats["empty_documents"]
                    summary.skipped_documents += shard_stats["skipped_documents"]
                    shard_stats = {"empty_documents": 0, "skipped_documents": 0}
                    shard_index += 1
                    writer = open_writer()
                first = last
            run_docs += int((lengths > 0).sum())
            run_tokens += int(lengths.sum())
            summary.input_bytes += read_bytes
            bar.update(read_bytes)
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(f"{run_docs / elapsed:,.0f} docs/s, {run_tokens / elapsed:,.0f} tok/s", refresh=False)
        if writer.documents or not sharded or shard_index == 0 or shard_stats != {"empty_documents": 0, "skipped_documents": 0}:
            outputs.append(writer.prefix)
            summary.documents += writer.documents
            summary.tokens += writer.tokens
            summary.empty_documents += shard_stats["empty_documents"]
            summary.skipped_documents += shard_stats["skipped_documents"]
            end = [len(files), 0]
            writer.finalize({**meta_common, "input_end": end, "stats": dict(shard_stats)})
        else:
            writer.abort()
        engine.close()
    except BaseException:
        writer.abort()
        engine.close(terminate=True)
        raise
    finally:
        bar.close()

    if sharded and config.merge:
        stats = {"empty_documents": summary.empty_documents, "skipped_documents": summary.skipped_documents}
        # overwrite: _check_output_directory refused another run's data here, so what remains is this run's own
        indexed_io.merge_datasets(outputs, final_prefix, {"run": signature, "input_end": [len(files), 0], "stats": stats},
                                  overwrite=True)
        if not config.keep_shards:
            for prefix in outputs:
                indexed_io.remove_dataset(prefix)
        outputs = [final_prefix]
    summary.outputs = outputs
    summary.seconds = time.perf_counter() - started
    return summary
