"""Training data: megatron-core GPT datasets over preprocessed .bin/.idx, in a fixed global order.

The global sample order is megatron's (GPTDataset shuffles documents and samples with a seed);
step k consumes global samples [k*G, (k+1)*G). Each global batch is cut into micro-batches of
``micro_batch_size x dp`` samples, and data-parallel rank r takes its slice of each: the same
split Megatron-LM uses, so DP=1 and DP=2 see the same global batch. ``consumed_samples`` goes in
the checkpoint and is all a resume needs to continue the stream exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader

from megatron_iiet.data.blend import validate_blend
from megatron_iiet.data.tokenizer import Tokenizer
from megatron_iiet.distributed import barrier, on_rank0
from megatron_iiet.training.config import TrainConfig
from megatron_iiet.training.signals import ignore_preemption_signals


@dataclass
class DataSources:
    tokenizer: Tokenizer
    train_blend: list[tuple[float, str]]
    valid_blend: Optional[list[tuple[float, str]]]


def resolve_sources(cfg: TrainConfig, rank: int = 0) -> DataSources:
    """The tokenizer and blends a config names; the built-in corpus when it names none.

    Everything is checked here, before any model is built: paths, intact indexes, that every
    dataset was made with the configured tokenizer (fingerprints), its recorded checksums (unless
    data.verify_checksums is off) and that no token id lies outside the tokenizer's vocabulary.
    """
    data = cfg.data
    if data.train is None:
        from megatron_iiet.data.prepare import prepare_builtin_corpus

        if data.tokenizer is not None:
            raise ValueError("data.tokenizer: set data.train too (the built-in corpus brings its own)")
        marker = Path(data.builtin_dir) / ".prepared"
        if rank == 0:
            prepared = prepare_builtin_corpus(data.builtin_dir, vocab_size=data.builtin_vocab_size,
                                              corpus_size=data.builtin_corpus_size)
            marker.write_text(prepared.data_prefix)
        barrier()
        tokenizer_path = str(Path(data.builtin_dir) / "tokenizer" / "tokenizer.model")
        train_spec: object = marker.read_text()
    else:
        if data.tokenizer is None:
            raise ValueError("data.tokenizer: required when data.train is set")
        tokenizer_path, train_spec = data.tokenizer, data.train
    if not Path(tokenizer_path).exists():
        raise ValueError(f"data.tokenizer: {tokenizer_path} does not exist")
    tokenizer = Tokenizer.from_path(tokenizer_path)
    checks = dict(expected_fingerprint=tokenizer.fingerprint, verify_checksums=data.verify_checksums,
                  vocab_size=tokenizer.vocab_size)

    def check_blends():
        try:
            return (validate_blend(train_spec, **checks),
                    validate_blend(data.valid, **checks) if data.valid is not None else None)
        except ValueError as e:
            raise ValueError(f"data: {e}") from e

    # Rank 0 reads the files once for all (a checksum is a full read); every rank gets its verdict.
    train, valid = on_rank0(check_blends)
    return DataSources(tokenizer, train, valid)


def _megatron_tokenizer(tokenizer: Tokenizer):
    # GPTDataset reads only these attributes; unique_identifiers keys its index cache
    return SimpleNamespace(vocab_size=tokenizer.vocab_size, eod=tokenizer.eod_id, pad=-1,
                           eos=tokenizer.eos_id,
                           unique_identifiers={"fingerprint": tokenizer.fingerprint})


def build_datasets(cfg: TrainConfig, sources: DataSources):
    """(train, valid) megatron GPTDatasets sized for the whole run."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    par, sched = cfg.parallel, cfg.schedule
    train_samples = sched.train_steps * par.global_batch_size
    evals = sched.train_steps // cfg.eval.interval + 1 if cfg.eval.interval else 1
    valid_samples = cfg.eval.steps * par.global_batch_size * evals

    def blend(pairs):
        # megatron wants no weights for a single dataset (then split sizes may be left open)
        return ([p for _, p in pairs], [w for w, _ in pairs] if len(pairs) > 1 else None)

    test_samples = None if len(sources.train_blend) == 1 else valid_samples

    common = dict(
        random_seed=cfg.seed,
        sequence_length=cfg.data.seq_length,
        tokenizer=_megatron_tokenizer(sources.tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=cfg.data.cache_dir or str(Path(cfg.logging.dir) / "data_cache"),
        mid_level_dataset_surplus=0.05,
    )
    if sources.valid_blend is None:
        _check_split_nonempty(cfg.data.split, sources.train_blend)
        ds_cfg = GPTDatasetConfig(blend=blend(sources.train_blend), split=cfg.data.split, **common)
    else:
        ds_cfg = GPTDatasetConfig(
            blend_per_split=[blend(sources.train_blend), blend(sources.valid_blend), None],
            **common,
        )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, test_samples], lambda: True, ds_cfg
    ).build()
    if valid is None:
        raise ValueError(
            f"data.split: {cfg.data.split!r} leaves no validation data; give it a validation "
            "share or set data.valid"
        )
    return train, valid


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
                raise ValueError(f"data.split: {split!r} gives no {name} share")
            count = int(round(bounds[1] * docs)) - int(round(bounds[0] * docs))
            if count == 0:
                raise ValueError(
                    f"data.split: the {name} share of {split!r} holds no documents of {prefix} "
                    f"({docs} documents); enlarge it or give data.valid")


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
    from megatron_iiet.platform import compute_device

    device = compute_device()  # the model's (on a GPU, batches must follow it there)
    return ({k: v.to(device, non_blocking=True) for k, v in _to_model_batch(b).items()}
            for b in loader)
