"""In-loop evaluation: lm-eval tasks on the live model during pretraining, on the training ranks
(at their TP/PP/DP layout), with no checkpoint save or export in between.

Enabled by ``eval.tasks`` (and ``eval.tasks_interval``, ``eval.tasks_limit``, ...). Metrics go to
metrics.jsonl as ``{"kind": "tasks", "step": N, "piqa/acc": ...}`` and to TensorBoard under
``tasks/<task>/<metric>``. The random-number state of every rank is restored afterwards, so a
run with task evaluation trains exactly as one without it.

A preemption signal that arrives while tasks are scored cuts the evaluation short at the next
batch (no `tasks` record for that step) and the run saves that step and stops, well inside the
launcher's grace period.
"""

from __future__ import annotations

import time
from typing import Optional

from megatron_iiet.training.callbacks import Callback


class TaskEvaluationCallback(Callback):
    """Score ``tasks`` (resolved names) every ``section.tasks_interval`` steps (0: only at the
    end) and at the end of a run that reaches the end of its schedule."""

    def __init__(self, section, tasks: list[str], tokenizer, max_length: int, preemption=None):
        self.section = section
        self.preemption = preemption
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.scorer = None
        self.last_step: Optional[int] = None
        self.last_metrics: dict[str, float] = {}

    def on_train_begin(self, trainer):
        from megatron_iiet.eval.scoring import ParallelScorer

        # Every rank builds it now (it creates a process group: a collective).
        self.scorer = ParallelScorer(trainer.engine.model, self.section.tasks_batch_size,
                                     self.max_length, decode=self.tokenizer.decode,
                                     progress=False,
                                     interrupted=self.preemption and self.preemption.stop_requested,
                                     raising=self.preemption and self.preemption.raising)

    def on_step_end(self, trainer, event):
        interval = self.section.tasks_interval
        if interval and event.step % interval == 0:
            self._evaluate(trainer, event.step)

    def on_train_end(self, trainer, finished):
        if finished and self.last_step != trainer.state.step:
            self._evaluate(trainer, trainer.state.step)

    def _evaluate(self, trainer, step: int) -> None:
        from megatron_iiet.eval.harness import flat_metrics, run_tasks
        from megatron_iiet.eval.native_lm import IIETMegatronLM
        from megatron_iiet.eval.scoring import EvaluationInterrupted
        from megatron_iiet.training.callbacks import stop_for_preemption
        from megatron_iiet.training.engines import rng_state, set_rng_state

        limit = self.section.tasks_limit
        limit = int(limit) if limit is not None and limit >= 1 else limit
        saved = rng_state()
        trainer.engine.train(False)
        t0 = time.perf_counter()
        try:
            lm = IIETMegatronLM(scorer=self.scorer, tokenizer_object=self.tokenizer)
            results = self.scorer.drive(lambda: run_tasks(
                lm, self.tasks, limit, self.section.tasks_data_dir, bootstrap_iters=0))
        except EvaluationInterrupted as cut:
            stop_for_preemption(trainer, self.preemption, step, f"task evaluation ({cut})")
            return
        finally:
            trainer.engine.train(True)
            set_rng_state(saved)
        self.last_step = step
        if results is None:  # a serving rank
            return
        self.last_metrics = flat_metrics(results)
        seconds = time.perf_counter() - t0
        trainer.reporter.event("tasks", step, seconds=seconds, **self.last_metrics)
        shown = ", ".join(f"{k} {v:.4g}" for k, v in self.last_metrics.items())
        trainer.reporter.message(f"tasks at step {step} ({seconds:.1f}s): {shown}")


def task_evaluation(cfg, tokenizer, preemption) -> Optional[TaskEvaluationCallback]:
    """The ``eval.tasks`` section's callback (None without tasks), its tasks checked (names,
    data files) before anything is trained."""
    if not cfg.eval.tasks:
        return None
    from megatron_iiet.distributed import on_rank0
    from megatron_iiet.eval.tasks import resolve_tasks

    tasks = on_rank0(lambda: resolve_tasks(cfg.eval.tasks, cfg.eval.tasks_data_dir))
    return TaskEvaluationCallback(cfg.eval, tasks, tokenizer, cfg.data.seq_length, preemption)
