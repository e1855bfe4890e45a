"""Precomputed teacher logits (spec 6.4, the offline path): the teacher's top-k (ids + values)
for every token of the first N samples of a run's training dataset, in the dataset's own sample
order, so the distillation loop finds a micro-batch's teacher by its sample indices.

A folder holds ``index.json`` (what the shards belong to: the dataset's identity, the
tokenizer, the teacher, k, dtype, the shard size) and ``shard_00000.pt`` ... , each the samples
``[i * shard_samples, (i + 1) * shard_samples)``: ``ids`` int32 ``[n, seq, k]``, ``values``
(fp16 / bf16 / fp32) ``[n, seq, k]``, and ``token_sums`` int64 ``[n]`` (the sum of each
sample's input ids, checked against every micro-batch: a misaligned dataset is found at once).
Each shard is written atomically (temp file, then rename), so a killed run leaves only whole
shards, and a rerun computes the missing ones alone.
"""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_iiet.data.tokenizer import fingerprint_matches
from megatron_iiet.errors import BadInput

FORMAT = "iiet-teacher-topk/1"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def dataset_identity(dataset, tokenizer_fingerprint: str) -> dict:
    """What makes two training datasets give the same samples in the same order."""
    return {"unique_description_hash": dataset.unique_description_hash,
            "sequence_length": int(dataset.config.sequence_length),
            "tokenizer_fingerprint": tokenizer_fingerprint}


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.pt"


def shard_bytes(ids: torch.Tensor, values: torch.Tensor, token_sums: torch.Tensor,
                first: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"ids": ids.to(torch.int32).contiguous(), "values": values.contiguous(),
                "token_sums": token_sums.to(torch.int64).contiguous(), "first": first}, buffer)
    return buffer.getvalue()


@dataclass
class OfflineTeacher:
    """A teacher read from precomputed top-k logits; ``topk(batch)`` gives the micro-batch's
    (ids, values) ``[b, s, k]``."""

    name: str
    weight: float
    root: Path
    index: dict
    where: str

    @classmethod
    def open(cls, path, where: str, weight: float, name: Optional[str], dataset,
             tokenizer_fingerprint: str, vocab_size: int, samples_needed: int) -> "OfflineTeacher":
        """Checked against the run before the first step: same dataset and tokenizer, enough
        samples, every shard present."""
        root = Path(path)
        index_file = root / "index.json"
        if not index_file.is_file():
            raise BadInput(f"{where}: {root} holds no index.json (precompute it with "
                           "tools/precompute_teacher_logits.py)")
        index = json.loads(index_file.read_text())
        if index.get("format") != FORMAT:
            raise BadInput(f"{where}: {index_file} is not a {FORMAT} index")
        mine = dataset_identity(dataset, tokenizer_fingerprint)
        theirs = index["dataset"]
        diffs = [f"{k}: logits {theirs.get(k)!r} vs run {v!r}" for k, v in mine.items()
                 if theirs.get(k) != v and not (k == "tokenizer_fingerprint"
                                                and fingerprint_matches(theirs.get(k), v))]
        if diffs:
            raise BadInput(f"{where}: the logits in {root} do not match this run's training "
                           f"data ({'; '.join(diffs)})")
        if index["teacher"].get("vocab_size") not in (None, vocab_size):
            raise BadInput(f"{where}: teacher vocabulary {index['teacher']['vocab_size']} vs the "
                           f"student's {vocab_size}")
        if index["num_samples"] < samples_needed:
            raise BadInput(f"{where}: {root} covers {index['num_samples']} samples, the run "
                           f"reads {samples_needed}")
        missing = [shard_name(i) for i in range(index["num_shards"])
                   if not (root / shard_name(i)).is_file()]
        if missing:
            raise BadInput(f"{where}: {root} is incomplete ({len(missing)} of "
                           f"{index['num_shards']} shards missing, e.g. {missing[0]}); rerun "
                           "the precompute, which resumes")
        return cls(name or f"{index['teacher'].get('architecture', 'teacher')}_topk", weight,
                   root, index, where)

    def __post_init__(self):
        self._cache: OrderedDict[int, dict] = OrderedDict()

    def _shard(self, i: int) -> dict:
        if i not in self._cache:
            self._cache[i] = torch.load(self.root / shard_name(i), weights_only=True)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        self._cache.move_to_end(i)
        return self._cache[i]

    def topk(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.index["shard_samples"]
        ids, values, sums = [], [], []
        for sample in batch["sample_index"].tolist():
            shard = self._shard(sample // per)
            row = sample - shard["first"]
            ids.append(shard["ids"][row])
            values.append(shard["values"][row])
            sums.append(int(shard["token_sums"][row]))
        actual = batch["input_ids"].sum(dim=-1).tolist()
        if actual != sums:
            raise BadInput(f"{self.where}: samples {batch['sample_index'].tolist()} are not the "
                           f"tokens the logits in {self.root} were computed on")
        device = batch["input_ids"].device
        return torch.stack(ids).to(device).long(), torch.stack(values).to(device)
