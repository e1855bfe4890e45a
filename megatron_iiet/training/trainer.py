"""The training loop.

``Trainer.fit`` is the whole loop: next global batch -> ``engine.train_step`` -> callbacks.
Everything else a run does (metrics, validation, checkpoints, preemption, non-finite steps) is a
callback (callbacks.py); the loss comes from the engine's ``Objective`` (step.py). A run is
assembled from its config above this package, in ``megatron_iiet/run.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from megatron_iiet.training.callbacks import Callback, StepEnd
from megatron_iiet.training.checkpointing import TrainingState


@dataclass
class TrainSummary:
    steps: int
    params_sha256: str
    final_loss: Optional[float]
    valid_loss: Optional[float]
    checkpoint: Optional[str]
    log_dir: str
    preempted: bool


class Trainer:
    """Runs ``engine`` from ``state`` to ``train_steps``; ``batches`` (a generator, closed at
    the end so that data-loader workers exit) yields each step's micro-batches, ``evaluate``
    returns a validation loss (None: cut short by a preemption signal)."""

    def __init__(self, engine, state: TrainingState, batches: Iterator[list[dict]],
                 evaluate: Callable[[], Optional[float]], reporter, callbacks: list[Callback],
                 train_steps: int, global_batch_size: int, meta_extra: dict,
                 checkpoint: Optional[str] = None):
        self.engine, self.state, self.batches = engine, state, batches
        self._evaluate, self.reporter, self.callbacks = evaluate, reporter, callbacks
        self.train_steps, self.global_batch_size = train_steps, global_batch_size
        self.meta_extra = meta_extra
        self.last_checkpoint = checkpoint
        self.last_loss: Optional[float] = None
        self.valid_loss: Optional[float] = None
        self.stop_reason: Optional[str] = None
        self.save_requested = False
        self.preempted = False

    # ---- what callbacks call --------------------------------------------------------------
    def request_stop(self, reason: str, save: bool = False, preempted: bool = False) -> None:
        """Stop after the current step (callbacks later in the list still see it)."""
        self.stop_reason = self.stop_reason or reason
        self.save_requested |= save
        self.preempted |= preempted

    def evaluate(self) -> Optional[float]:
        self.engine.train(False)
        try:
            return self._evaluate()
        finally:
            self.engine.train(True)

    def emit_validation(self, step: int, loss: float) -> None:
        self.valid_loss = loss
        for cb in self.callbacks:
            cb.on_validation(self, step, loss)

    def save(self, manager) -> str:
        t0 = time.perf_counter()
        path = str(manager.save(self.engine, self.state, self.meta_extra))
        seconds = time.perf_counter() - t0
        self.last_checkpoint = path
        for cb in self.callbacks:
            cb.on_save(self, path, seconds)
        return path

    def _before_optimizer_step(self) -> None:
        for cb in self.callbacks:
            cb.on_before_optimizer_step(self)

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self) -> TrainSummary:
        try:
            self.engine.train(True)
            for cb in self.callbacks:
                cb.on_train_begin(self)
            while self.state.step < self.train_steps and self.stop_reason is None:
                micro_batches = next(self.batches)
                t0 = time.perf_counter()
                result = self.engine.train_step(micro_batches, self._before_optimizer_step)
                event = StepEnd(self.state.step + 1, result, time.perf_counter() - t0)
                self.state.step += 1
                self.state.consumed_samples += self.global_batch_size
                self.state.skipped_steps += int(result.skipped)
                self.last_loss = result.loss
                self.save_requested = False
                for cb in self.callbacks:
                    cb.on_step_end(self, event)
            finished = self.state.step >= self.train_steps
            for cb in reversed(self.callbacks):
                cb.on_train_end(self, finished)
            digest = self.engine.parameters_digest()
            self.reporter.event("end", self.state.step, params_sha256=digest, finished=finished,
                                preempted=self.preempted)
        finally:
            self.batches.close()
            self.reporter.close()
        return TrainSummary(self.state.step, digest, self.last_loss, self.valid_loss,
                            self.last_checkpoint, str(self.reporter.root), self.preempted)
