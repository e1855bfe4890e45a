"""What a resume keeps from the checkpoint and what it takes from the new config.

The rule per field, decided once here (docs/training.md, "Resuming with a changed config"):

- ``schedule.*`` and ``optimizer.lr / min_lr / weight_decay``: the new config wins; its schedule
  is evaluated at the saved step (engines.build_scheduler), as Megatron-LM's
  --override-opt_param-scheduler and torchtitan do. Extending 30 to 40 steps continues the
  cosine toward the new end instead of running 10 steps at min_lr.
- ``parallel.global_batch_size``: the samples already consumed stay consumed; the stream goes on
  from ``consumed_samples`` in the same global order, G_new samples a step (the order does not
  depend on the batch size: training/data.py), so nothing repeats and nothing is skipped.
- ``data.seq_length``: refused, because the saved sample position counts sequences of the old
  length; ``checkpoint.load_model_only`` starts a new stream on the same weights instead.

Checkpoints written before the order was made independent of the run's size (no
``data_order`` in their metadata) resume in their own order, which megatron sized for
train_steps x global batch: for them a change of either is refused rather than reshuffled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_iiet.errors import BadInput
from megatron_iiet.training.config import TrainConfig
from megatron_iiet.training.checkpoint_meta import CheckpointMeta
from megatron_iiet.training.data import ORDER_VERSION

_SCHEDULE_FIELDS = (("schedule", "train_steps"), ("schedule", "warmup_steps"),
                    ("schedule", "decay_style"), ("optimizer", "lr"), ("optimizer", "min_lr"),
                    ("optimizer", "weight_decay"), ("parallel", "global_batch_size"))


@dataclass
class ResumePoint:
    step: int = 0
    consumed_samples: int = 0
    legacy_order: bool = False
    """The checkpoint predates the size-independent sample order (training/data.py)."""
    changes: list[str] = field(default_factory=list)
    """``section.field old -> new`` for every schedule/batch field that differs."""


def resume_point(meta: Optional[CheckpointMeta], cfg: TrainConfig, model_only: bool,
                 path: object = "the checkpoint", keep_position: bool = False) -> ResumePoint:
    """Where the stream continues, and the config changes the resume applies; an operator error
    for a change that cannot be applied. ``keep_position``: a weights-only start that still
    continues the checkpoint's step and stream (checkpoint.init_from_position)."""
    if meta is None or meta.model_only or (model_only and not keep_position):
        return ResumePoint()
    saved = meta.config or {}

    def old(section: str, name: str):
        return (saved.get(section) or {}).get(name)

    old_seq = old("data", "seq_length")
    if old_seq is not None and old_seq != cfg.data.seq_length:
        raise BadInput(
            f"data.seq_length: {path} was trained with {old_seq}, this config says "
            f"{cfg.data.seq_length}; its data position counts sequences of {old_seq} tokens. "
            "Keep the length, or set checkpoint.load_model_only=true to start a new data stream "
            "on these weights")
    point = ResumePoint(step=meta.step, consumed_samples=meta.consumed_samples,
                        legacy_order=meta.data_order != ORDER_VERSION)
    for section, name in _SCHEDULE_FIELDS:
        before, now = old(section, name), getattr(getattr(cfg, section), name)
        if before is not None and before != now:
            point.changes.append(f"{section}.{name} {before} -> {now}")
    if cfg.schedule.train_steps < point.step:
        raise BadInput(f"schedule.train_steps: {cfg.schedule.train_steps} is below the step "
                       f"{path} has reached ({point.step})")
    if point.legacy_order and any(c.startswith(("schedule.train_steps", "parallel.global_batch"))
                                  for c in point.changes):
        raise BadInput(
            f"{path} was written before the sample order stopped depending on the run's length "
            "and batch size, so resuming it with another schedule.train_steps or "
            "parallel.global_batch_size would reshuffle the data it has seen; keep both, or set "
            "checkpoint.load_model_only=true")
    return point


def samples_needed(cfg: TrainConfig, point: ResumePoint) -> int:
    """Samples the whole run reads: those consumed plus the remaining steps' batches."""
    remaining = cfg.schedule.train_steps - point.step
    return point.consumed_samples + remaining * cfg.parallel.global_batch_size
