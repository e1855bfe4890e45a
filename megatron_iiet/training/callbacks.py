"""Training features as callbacks: the loop runs "next batch -> engine step -> callbacks" and
each feature (metrics, validation, checkpoints, preemption, non-finite steps) lives in one
small class that can be tested alone. A custom callback is any subclass of ``Callback`` passed to
``Trainer(callbacks=...)``; it can log through ``trainer.reporter`` and ask the trainer to save
or stop.

Order: ``on_train_begin`` and ``on_step_end`` run in list order, ``on_train_end`` in reverse,
like the setup and teardown of a stack: of the built-in ones the checkpoint callback (last)
saves first, then the final validation runs, and metrics (first) see everything. A custom
callback goes after the built-in ones. ``on_validation`` and ``on_save`` go to every callback, in
list order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from megatron_iiet.training.engines import StepResult
    from megatron_iiet.training.trainer import Trainer


@dataclass
class StepEnd:
    """What a callback learns after each step (``trainer.state`` holds the counters)."""

    step: int
    result: "StepResult"
    seconds: float


class Callback:
    def on_train_begin(self, trainer: "Trainer") -> None:
        pass

    def on_before_optimizer_step(self, trainer: "Trainer") -> None:
        """The step's gradients are summed over micro-batches and reduced over ranks, not yet
        clipped or applied: ``trainer.engine.gradients()`` reads them (either engine, any
        precision). Not called for a step skipped as non-finite."""

    def on_step_end(self, trainer: "Trainer", event: StepEnd) -> None:
        pass

    def on_validation(self, trainer: "Trainer", step: int, loss: float) -> None:
        pass

    def on_save(self, trainer: "Trainer", path: str, seconds: float) -> None:
        pass

    def on_train_end(self, trainer: "Trainer", finished: bool) -> None:
        pass


class MetricsCallback(Callback):
    """A training record every ``interval`` steps (and at step 1, and for every skipped step):
    loss (and the objective's terms), lr, gradient norm, throughput and MFU, optimizer-state
    size, memory; validation records; a checkpoint record per save."""

    def __init__(self, interval: int, throughput):
        self.interval = interval
        self.throughput = throughput

    def on_step_end(self, trainer, event):
        from megatron_iiet.training.engines import optimizer_state_bytes
        from megatron_iiet.training.metrics import memory_mb, optional_float

        r = event.result
        if r.skipped or event.step % self.interval == 0 or event.step == 1:
            trainer.reporter.log_step(
                event.step, loss=r.loss, lr=r.lr, grad_norm=optional_float(r.grad_norm),
                skipped_steps=trainer.state.skipped_steps, **r.terms,
                **self.throughput(event.seconds),
                optimizer_state_mb=optimizer_state_bytes(trainer.engine.optimizer) / 2**20,
                **memory_mb())

    def on_validation(self, trainer, step, loss):
        trainer.reporter.log_eval(step, loss)


class TooManySkippedSteps(RuntimeError):
    pass


class NonFiniteCallback(Callback):
    """Say so for every step whose loss was not finite (its update was skipped) and stop the run
    once more than ``limit`` were (the count is checkpointed)."""

    def __init__(self, limit: int):
        self.limit = limit

    def on_step_end(self, trainer, event):
        if not event.result.skipped:
            return
        skipped = trainer.state.skipped_steps
        trainer.reporter.message(f"step {event.step}: non-finite loss {event.result.loss}, "
                                 f"update skipped ({skipped}/{self.limit})")
        if skipped > self.limit:
            raise TooManySkippedSteps(f"{skipped} steps with non-finite loss (limit "
                                      f"logging.max_skipped_steps={self.limit})")


class ValidationCallback(Callback):
    """Validate every ``interval`` steps (0: never during training) and at the end of a run
    that reaches the end of its schedule."""

    def __init__(self, interval: int):
        self.interval = interval
        self.last_step: Optional[int] = None
        self.last_loss: Optional[float] = None

    def _validate(self, trainer, step: int) -> None:
        loss = trainer.evaluate()
        if loss is None:  # cut short: PreemptionCallback, next in line, saves this step
            trainer.reporter.message(f"validation at step {step} cut short by a preemption")
            return
        self.last_step, self.last_loss = step, loss
        trainer.emit_validation(step, self.last_loss)

    def on_step_end(self, trainer, event):
        if self.interval and event.step % self.interval == 0:
            self._validate(trainer, event.step)

    def on_train_end(self, trainer, finished):
        if finished and self.last_step != trainer.state.step:
            self._validate(trainer, trainer.state.step)


def stop_for_preemption(trainer, handler, step: int, cut_short: Optional[str] = None) -> None:
    """Ask ``trainer`` to save ``step`` and stop, as ``handler`` (a PreemptionHandler that said
    stop) asks; ``cut_short`` names an evaluation it interrupted."""
    reason = handler.reason or "a preemption signal reached another rank"
    during = f", {cut_short} cut short" if cut_short else ""
    trainer.reporter.message(f"preemption: {reason}{during}; stopped after step {step}")
    trainer.reporter.event("preempted", step, reason=reason,
                           **({"cut_short": cut_short} if cut_short else {}))
    trainer.request_stop(f"preemption: {reason}", save=True, preempted=True)


class PreemptionCallback(Callback):
    """A preemption signal, or a lost launcher, on any rank: save this step and stop. Validation
    and in-loop task evaluation ask too, between their batches, and give way to the save."""

    def __init__(self, handler):
        self.handler = handler

    def on_step_end(self, trainer, event):
        if self.handler.stop_requested():  # a collective: every rank asks at every step
            stop_for_preemption(trainer, self.handler, event.step)


class ExitIntervalCallback(Callback):
    """``schedule.exit_interval``: save and stop after this many steps of this run."""

    def __init__(self, steps: int):
        self.steps = steps
        self.first_step = 0

    def on_train_begin(self, trainer):
        self.first_step = trainer.state.step

    def on_step_end(self, trainer, event):
        if event.step - self.first_step >= self.steps:
            trainer.reporter.message(f"schedule.exit_interval: stopped after step {event.step}")
            trainer.request_stop("schedule.exit_interval", save=True)


class ExitDurationCallback(Callback):
    """``schedule.exit_duration_minutes``: save and stop at the first step end after the run
    has lasted this long since ``started`` (a ``time.monotonic()`` reading taken before
    set-up). Ranks started and stepped at slightly different times, so the longest elapsed
    time over them decides, in one collective per step: every rank stops at the same step."""

    def __init__(self, minutes: float, started: float, clock=time.monotonic):
        self.seconds = 60.0 * minutes
        self.started = started
        self.clock = clock

    def on_step_end(self, trainer, event):
        import torch
        import torch.distributed as dist

        elapsed = self.clock() - self.started
        over = torch.tensor([int(elapsed >= self.seconds)], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item():
            trainer.reporter.message(
                f"schedule.exit_duration_minutes: stopped after step {event.step}, "
                f"{elapsed / 60:.2f} min into the run (limit {self.seconds / 60:g})")
            trainer.request_stop("schedule.exit_duration_minutes", save=True)


class CheckpointCallback(Callback):
    """Save every ``interval`` steps, when the trainer is asked to save (stop requests), and at
    the end of the schedule; commit asynchronous saves as they finish."""

    def __init__(self, manager, interval: int, resumed_step: Optional[int]):
        self.manager = manager
        self.interval = interval
        self.saved_step = resumed_step

    def _save(self, trainer) -> None:
        trainer.save(self.manager)
        self.saved_step = trainer.state.step

    def on_step_end(self, trainer, event):
        self.manager.finalize_pending()
        if trainer.save_requested or (self.interval and event.step % self.interval == 0):
            self._save(trainer)

    def on_train_end(self, trainer, finished):
        # A save asked for by a callback after this one (a preempted task evaluation) is due too.
        if (finished or trainer.save_requested) and self.saved_step != trainer.state.step:
            self._save(trainer)
        self.manager.close()


class CheckpointRecords(Callback):
    """A `checkpoint` record (path, seconds, size) per save."""

    def __init__(self, async_save: bool):
        self.async_save = async_save

    def on_save(self, trainer, path, seconds):
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if (
            trainer.reporter.enabled and Path(path).exists()) else None
        trainer.reporter.event("checkpoint", trainer.state.step, path=path, seconds=seconds,
                               bytes=size, async_save=self.async_save)
