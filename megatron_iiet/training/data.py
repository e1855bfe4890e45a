"""Training data: megatron-core GPT datasets over preprocessed .bin/.idx, in a fixed global order.

The global sample order is megatron's (GPTDataset shuffles documents and samples with a seed),
one epoch at a time, so it depends on the data, the seed and the sequence length but not on the
run's length or batch size. A step consumes the next G (global batch) samples. Each global
batch is cut into micro-batches of ``micro_batch_size x dp`` samples, and data-parallel rank r
takes its slice of each: the same split Megatron-LM uses, so DP=1 and DP=2 see the same global
batch. ``consumed_samples`` goes in the checkpoint and is all a resume needs to continue the
stream exactly, also with a longer schedule or another global batch size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader

from megatron_iiet.data.blend import validate_blend
from megatron_iiet.data.tokenizer import Tokenizer
from megatron_iiet.distributed import on_rank0
from megatron_iiet.errors import BadInput
from megatron_iiet.training.config import TrainConfig
from megatron_iiet.training.signals import ignore_preemption_signals


@dataclass
class DataSources:
    tokenizer: Tokenizer
    train_blend: list[tuple[float, str]]
    valid_blend: Optional[list[tuple[float, str]]]


def resolve_sources(cfg: TrainConfig, builtin: Optional[tuple[str, str]] = None) -> DataSources:
    """The tokenizer and blends a config names; ``builtin`` (tokenizer, data prefix) stands in
    for data.train and data.tokenizer when the config names none: the built-in corpus, which the
    entry points prepare (``megatron_iiet.data.prepare.builtin_corpus``), not this module.

    Everything is checked here, before any model is built: paths, intact indexes, that every
    dataset was made with the configured tokenizer (fingerprints), its recorded checksums (unless
    data.verify_checksums is off) and that no token id lies outside the tokenizer's vocabulary.
    """
    data = cfg.data
    if data.train is None:
        if builtin is None:
            raise BadInput("data.train: not set, and no built-in corpus was prepared "
                           "(pretrain_iiet.py prepares it when data.train is unset)")
        tokenizer_path, train_spec = builtin
    else:
        if data.tokenizer is None:
            raise BadInput("data.tokenizer: required when data.train is set")
        tokenizer_path, train_spec = data.tokenizer, data.train
    if not Path(tokenizer_path).exists():
        raise BadInput(f"data.tokenizer: {tokenizer_path} does not exist")
    tokenizer = Tokenizer.from_path(tokenizer_path)
    checks = dict(expected_fingerprint=tokenizer.fingerprint, verify_checksums=data.verify_checksums,
                  vocab_size=tokenizer.vocab_size)

    def check_blends():
        try:
            return (validate_blend(train_spec, **checks),
                    validate_blend(data.valid, **checks) if data.valid is not None else None)
        except ValueError as e:  # validate_blend's contract: every refusal is a ValueError
            raise BadInput(f"data: {e}") from e

    # Rank 0 reads the files once for all (a checksum is a full read); every rank gets its verdict.
    train, valid = on_rank0(check_blends)
    return DataSources(tokenizer, train, valid)


def _megatron_tokenizer(tokenizer: Tokenizer):
    # GPTDataset reads only these attributes; unique_identifiers keys its index cache and the
    # dataset hash precomputed teacher logits record: the legacy fingerprint keeps both valid
    # (the sample order does not depend on the merges; the data's own identity is the path's)
    return SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod_id, pad=-1,
                           eos=tokenizer.eos_id,
                           unique_identifiers={"fingerprint": tokenizer.legacy_fingerprint})


def index_cache_dir(cfg: TrainConfig, sources: DataSources) -> str:
    """Where megatron caches the sample indices of this run's data: a folder of data.cache_dir
    per content of the datasets. megatron keys its cache by path, seed and sizes only, so data
    re-preprocessed into the same prefix was read through the old data's indices (issue 28: 753
    of 800 samples wrong, 47 IndexErrors), in every run and sweep sharing the folder. The key is
    the checksums preprocessing recorded in each meta.json (verified against the files before
    this, unless data.verify_checksums is off); megatron's own key, which precomputed teacher
    logits record, stays as it was."""
    from megatron_iiet.data import indexed_io

    signature = {}
    for prefix in sorted({p for _, p in sources.train_blend + (sources.valid_blend or [])}):
        meta = indexed_io.read_meta(prefix)
        signature[prefix] = ([meta["bin_sha256"], meta.get("idx_sha256")] if "bin_sha256" in meta
                             else [[f.stat().st_size, f.stat().st_mtime_ns]  # none recorded
                                   for f in indexed_io.dataset_files(prefix)])
    key = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
    root = cfg.data.cache_dir or str(Path(cfg.logging.dir) / "data_cache")
    return str(Path(root) / f"data-{key}")


ORDER_VERSION = "epoch_chunks"
"""Recorded in checkpoints whose sample order ``build_datasets`` makes independent of the run's
length and batch size; checkpoints without it resume in the legacy order (``legacy_order``)."""

_CHUNK_SEED_STRIDE = 7919
"""Chunk e of the training order is shuffled with seed + e x this (chunk 0 with the seed itself,
so a run within one epoch sees the order earlier versions gave it)."""


def build_datasets(cfg: TrainConfig, sources: DataSources, train_samples: Optional[int] = None,
                   legacy_order: bool = False):
    """(train, valid) megatron GPTDatasets covering ``train_samples`` (default: the whole run).

    The training order is a function of the data, the seed and the sequence length alone:
    chunks of one epoch each (for a blend, as many samples as its datasets hold sequences), chunk
    e shuffled with its own seed, concatenated. Asking megatron for N samples at once would tie
    the order of every epoch to N, so a longer schedule or another global batch size after a
    resume would reshuffle data already consumed. ``legacy_order``: the order of checkpoints
    written before (megatron sized for train_steps x global batch)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    par, sched = cfg.parallel, cfg.schedule
    needed = train_samples or sched.train_steps * par.global_batch_size
    evals = sched.train_steps // cfg.eval.interval + 1 if cfg.eval.interval else 1
    valid_samples = cfg.eval.steps * par.global_batch_size * evals

    def blend(pairs):
        # megatron wants no weights for a single dataset (then split sizes may be left open)
        return ([p for _, p in pairs], [w for w, _ in pairs] if len(pairs) > 1 else None)

    weighted = len(sources.train_blend) > 1
    test_samples = valid_samples if weighted else None

    def build(seed: int, train_size: Optional[int]):
        common = dict(
            random_seed=seed,
            sequence_length=cfg.data.seq_length,
            tokenizer=_megatron_tokenizer(sources.tokenizer),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            path_to_cache=index_cache_dir(cfg, sources),
            mid_level_dataset_surplus=0.05,
        )
        if sources.valid_blend is None:
            _check_split_nonempty(cfg.data.split, sources.train_blend)
            ds_cfg = GPTDatasetConfig(blend=blend(sources.train_blend), split=cfg.data.split,
                                      **common)
        else:
            ds_cfg = GPTDatasetConfig(
                blend_per_split=[blend(sources.train_blend), blend(sources.valid_blend), None],
                **common,
            )
        train, valid, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [train_size, valid_samples, test_samples], lambda: True, ds_cfg
        ).build()
        return train, valid

    if legacy_order:
        train, valid = build(cfg.seed, needed)
    else:
        # one epoch: megatron's own when the size is open (one dataset); counted for a blend
        chunk_size = _blend_sequences(sources.train_blend, cfg.data.seq_length) if weighted else None
        first, valid = build(cfg.seed, chunk_size)
        chunks = [first]
        while len(chunks) * len(first) < needed:
            chunks.append(build(cfg.seed + _CHUNK_SEED_STRIDE * len(chunks), chunk_size)[0])
        train = first if len(chunks) == 1 else ChunkedOrder(chunks)
    if valid is None:
        raise BadInput(
            f"data.split: {cfg.data.split!r} leaves no validation data; give it a validation "
            "share or set data.valid"
        )
    return train, valid


def _blend_sequences(pairs, seq_length: int) -> int:
    """Sequences the blend's datasets hold together: a weighted blend's chunk size."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens = sum(int(IndexedDataset(prefix).sequence_lengths.sum()) for _, prefix in pairs)
    return max(1, (tokens - len(pairs)) // seq_length)


class ChunkedOrder(torch.utils.data.Dataset):
    """Equal-sized chunks end to end: global sample i is sample i mod n of chunk i div n."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.chunk_len = len(chunks[0])
        assert all(len(c) == self.chunk_len for c in chunks), [len(c) for c in chunks]

    def __len__(self):
        return self.chunk_len * len(self.chunks)

    def __getitem__(self, index):
        chunk, within = divmod(index, self.chunk_len)
        return self.chunks[chunk][within]


def _check_split_nonempty(split: str, pairs) -> None:
    """megatron splits each dataset by document; an empty share makes GPTDataset loop forever
    looking for tokens, so refuse it here with a message instead."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for _, prefix in pairs:
        docs = len(IndexedDataset(prefix).document_indices) - 1
        for name, bounds in zip(("train", "validation"), matrix[:2]):
            if bounds is None:
                raise BadInput(f"data.split: {split!r} gives no {name} share")
            count = int(round(bounds[1] * docs)) - int(round(bounds[0] * docs))
            if count == 0:
                working = _working_split(docs)
                hint = (f"e.g. --set data.split={working} (one document for validation)"
                        if working else "it has too few documents to split")
                raise BadInput(
                    f"data.split: the {name} share of {split!r} holds no documents of {prefix} "
                    f"({docs} documents: megatron splits by document); {hint}, or give "
                    "data.valid (a held-out dataset)")


def _working_split(docs: int) -> Optional[str]:
    """The split with the smallest validation share that still holds a document (and leaves
    training the rest), in whole percent; None below two documents."""
    for valid in range(1, 51):
        train_end = int(round((100 - valid) / 100 * docs))
        if 0 < train_end < docs:
            return f"{100 - valid},{valid},0"
    return None


class MicroBatchSampler:
    """Index lists of this DP rank's micro-batches, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total = total_samples
        self.consumed = consumed_samples
        self.mb = micro_batch_size
        self.rank = dp_rank
        self.size = dp_size

    def __iter__(self):
        stride = self.mb * self.size
        start = self.consumed
        while start + stride <= self.total:
            first = start + self.rank * self.mb
            yield list(range(first, first + self.mb))
            start += stride

    def __len__(self):
        return (self.total - self.consumed) // (self.mb * self.size)


class _WithSampleIndex(torch.utils.data.Dataset):
    """The dataset's samples with their index (precomputed teacher logits are looked up by it)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return {**self.dataset[index], "sample_index": index}


def _to_model_batch(sample: dict) -> dict:
    return {"input_ids": sample["tokens"], "labels": sample["labels"],
            "loss_mask": sample["loss_mask"], "sample_index": sample["sample_index"]}


def micro_batch_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                       dp_size: int, num_workers: int, total_samples: Optional[int] = None
                       ) -> Iterator[dict]:
    """This rank's micro-batches in global order, starting after ``consumed_samples``."""
    sampler = MicroBatchSampler(total_samples or len(dataset), consumed_samples,
                                micro_batch_size, dp_rank, dp_size)
    # Its own generator: a loader with workers otherwise draws its base seed from the global
    # generator, shifting dropout masks whenever a loader is (re)created, e.g. after a resume.
    # Workers leave preemption signals to the trainer, whatever the start method.
    loader = DataLoader(_WithSampleIndex(dataset), batch_sampler=sampler, num_workers=num_workers,
                        persistent_workers=False, generator=torch.Generator().manual_seed(0),
                        worker_init_fn=ignore_preemption_signals if num_workers else None)
    return (_to_model_batch(b) for b in loader)  # forward_backward moves them to the model
