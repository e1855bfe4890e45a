"""IIAD distillation in the training loop (spec 6.3-6.4): the ``distill:`` section becomes an
``Objective`` (the loss) and a callback (the window, the teachers' cost); the loop is unchanged.

    loss = CE + kl_weight * sum_t w_t * T^2 * mean KL(teacher_t || student)

Teachers are frozen: a training checkpoint of any architecture loaded at the student's TP/PP
layout (resharded on load), run in eval mode without gradients, or precomputed top-k logits
(teacher_logits.py). Student and teacher logits stay vocab-parallel; the KL is computed on the
shards (kl.py).

Pipeline parallelism: a teacher is itself pipelined over the same stages, so its forward is a
pipeline schedule of its own. At PP=1 each micro-batch's teacher logits are computed when the
student's loss needs them (one micro-batch of logits alive at a time); at PP>1 the teachers run
over all micro-batches of the step first (megatron's forward-only schedule), and their logits,
which land on the last stage where the student's loss is, wait there in order: num_micro x
micro_batch x seq x vocab/TP values per teacher.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_iiet.errors import BadInput
from megatron_iiet.iiad.kl import masked_token_mean, topk_kl, vocab_parallel_kl
from megatron_iiet.training.callbacks import Callback
from megatron_iiet.training.step import Objective, masked_mean


@dataclass
class LiveTeacher:
    name: str
    weight: float
    model: torch.nn.Module
    checkpoint: str
    architecture: str

    def logits(self, batch: dict) -> torch.Tensor:
        with torch.no_grad():
            return self.model(batch["input_ids"])

    def step_logits(self, micro_batches: list[dict]) -> list[torch.Tensor]:
        """Its logits for every micro-batch, through the pipeline (last stage: all of them)."""
        from megatron_iiet.training.step import forward_only

        return forward_only(self.model, micro_batches, lambda m, b: m(b["input_ids"]),
                            lambda b, logits: logits)

    def parameter_bytes(self) -> int:
        """On this rank (a ZeRO-3 teacher: its partition)."""
        return sum(getattr(p, "ds_tensor", p).numel() * p.element_size()
                   for p in self.model.parameters())


class DistillationObjective(Objective):
    """The language-model loss plus the weighted KL of each teacher, on the steps of the window
    (``next_step`` is set by ``DistillationCallback``); plain LM loss elsewhere and in
    validation, so validation losses compare with pretraining's."""

    def __init__(self, teachers: list, kl_weight: float = 1.0, temperature: float = 1.0,
                 start_step: int = 0, end_step: Optional[int] = None,
                 positions: str = "labelled", pipelined: bool = False):
        super().__init__()
        self.teachers = teachers
        self.kl_weight, self.temperature = kl_weight, temperature
        self.start_step, self.end_step = start_step, end_step
        self.positions = positions
        self.pipelined = pipelined
        self.next_step = 1
        self.distilling = False
        self.teacher_seconds = 0.0
        self.peak_logits_bytes = 0
        self._queued: dict[str, deque] = {}

    def in_window(self, step: int) -> bool:
        return step > self.start_step and (self.end_step is None or step <= self.end_step)

    @property
    def metric_names(self) -> list[str]:
        if not self.distilling:
            return ["loss"]
        return ["loss", "lm", *(f"kl_{t.name}" for t in self.teachers)]

    def prepare(self, micro_batches: list[dict], training: bool) -> None:
        self.distilling = training and self.in_window(self.next_step)
        self.teacher_seconds = 0.0
        self._queued = {}
        if not (self.distilling and self.pipelined):
            return
        for t in self.teachers:
            if isinstance(t, LiveTeacher):
                t0 = time.perf_counter()
                logits = t.step_logits(micro_batches)
                self.teacher_seconds += time.perf_counter() - t0
                self._note_logits(logits)
                self._queued[t.name] = deque(logits)

    def _note_logits(self, held: list[torch.Tensor]) -> None:
        self.peak_logits_bytes = max(self.peak_logits_bytes,
                                     sum(x.numel() * x.element_size() for x in held))

    def forward(self, model, batch: dict) -> torch.Tensor:
        if not self.distilling:
            return super().forward(model, batch)
        return model(batch["input_ids"])  # vocab-parallel logits [b, s, V/TP] on the last stage

    def _kl(self, teacher, batch: dict, student_logits: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if isinstance(teacher, LiveTeacher):
            if self.pipelined:
                logits = self._queued[teacher.name].popleft()
            else:
                logits = teacher.logits(batch)
                self._note_logits([logits])
            self.teacher_seconds += time.perf_counter() - t0
            return vocab_parallel_kl(student_logits, logits, self.temperature)
        ids, values = teacher.topk(batch)
        self.teacher_seconds += time.perf_counter() - t0
        return topk_kl(student_logits, ids, values, self.temperature)

    def loss(self, batch: dict, output: torch.Tensor):
        if not self.distilling:
            return super().loss(batch, output)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        mask = batch["loss_mask"] if self.positions == "labelled" else None
        scale = self.temperature ** 2
        # The KLs first: megatron's cross entropy works in place on fp32 logits.
        kls = {f"kl_{t.name}": scale * masked_token_mean(self._kl(t, batch, output), mask)
               for t in self.teachers}
        lm = masked_mean(vocab_parallel_cross_entropy(output, batch["labels"]),
                         batch["loss_mask"])
        total = lm + self.kl_weight * sum(t.weight * kls[f"kl_{t.name}"] for t in self.teachers)
        return total, {"loss": total.detach().clone(), "lm": lm.detach().clone(),
                       **{k: v.detach().clone() for k, v in kls.items()}}


class DistillationCallback(Callback):
    """Tells the objective which step comes next (so the window survives a resume), says when
    distillation switches on and off, and logs the teachers' cost: a ``distill`` record every
    ``interval`` steps with the teachers' time in the step, their parameter memory on this rank
    and the largest block of teacher logits held at once."""

    def __init__(self, objective: DistillationObjective, interval: int):
        self.objective = objective
        self.interval = interval

    def on_train_begin(self, trainer):
        self.objective.next_step = trainer.state.step + 1
        o = self.objective
        names = ", ".join(f"{t.name} (weight {t.weight})" for t in o.teachers)
        window = f"steps {o.start_step + 1}..{o.end_step or trainer.train_steps}"
        trainer.reporter.message(f"distill: teachers {names}; {window}; T={o.temperature}, "
                                 f"kl_weight={o.kl_weight}, positions={o.positions}")

    def on_step_end(self, trainer, event):
        o = self.objective
        if o.distilling and (event.step % self.interval == 0 or event.step == o.start_step + 1):
            live = [t for t in o.teachers if isinstance(t, LiveTeacher)]
            trainer.reporter.event(
                "distill", event.step, teacher_seconds=o.teacher_seconds,
                teacher_fraction=o.teacher_seconds / max(event.seconds, 1e-9),
                teacher_params_mb=sum(t.parameter_bytes() for t in live) / 2**20,
                teacher_logits_mb=o.peak_logits_bytes / 2**20)
        if o.end_step is not None and event.step == o.end_step:
            trainer.reporter.message(f"distill: window ends at step {event.step}; plain "
                                     "training from here")
        o.next_step = event.step + 1


# ---- building from the config -----------------------------------------------------------------

def load_live_teacher(index: int, section, model_config,
                      tokenizer_fingerprint: str) -> LiveTeacher:
    """A frozen teacher from a training checkpoint, at this job's TP/PP layout; refused before
    the first step when its vocabulary or tokenizer is not the student's."""
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.training.checkpoint_index import CheckpointError, read_meta, \
        resolve_checkpoint
    from megatron_iiet.training.checkpoint_meta import check_tokenizer

    where = f"distill.teachers[{index}].checkpoint"
    try:
        path = resolve_checkpoint(section.checkpoint)
        meta = read_meta(path)
    except CheckpointError as err:
        raise BadInput(f"{where}: {err}") from None
    if meta.vocab_size != model_config.vocab_size:
        raise BadInput(f"{where}: {path} has a vocabulary of {meta.vocab_size} (padded), "
                       f"the student {model_config.vocab_size}: another tokenizer")
    check_tokenizer(meta.tokenizer_fingerprint, tokenizer_fingerprint,
                    f"{where}: {path} (the student's data)", BadInput)
    try:
        loaded = load_for_inference(path, with_tokenizer=False)
    except ValueError as err:
        raise BadInput(f"{where}: {err}") from None
    model = loaded.model
    for p in model.parameters():
        p.requires_grad_(False)
    if section.zero3:
        model = _zero3_partitioned(model)
    arch = meta.signature_value("architecture")
    return LiveTeacher(section.name or arch or f"t{index}", section.weight, model, str(path),
                       arch or "?")


def _zero3_partitioned(model: torch.nn.Module) -> torch.nn.Module:
    """The teacher held ZeRO-3-partitioned over the data-parallel ranks: DeepSpeed gathers each
    module's parameters for its forward and frees them after. No optimizer, eval mode."""
    import deepspeed
    from megatron.core import parallel_state as ps

    from megatron_iiet.training.engines import _MegatronMPU

    config = {"train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "data_parallel_size": ps.get_data_parallel_world_size()}
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=_MegatronMPU(),
                                      dist_init_required=False)
    engine.eval()
    return engine


def _unique_names(teachers: list) -> None:
    seen: dict[str, int] = {}
    for t in teachers:
        seen[t.name] = seen.get(t.name, 0) + 1
    counts: dict[str, int] = {}
    for t in teachers:
        if seen[t.name] > 1:
            counts[t.name] = counts.get(t.name, 0) + 1
            t.name = f"{t.name}{counts[t.name]}"


def build_distillation(cfg, model_config, tokenizer, train_dataset):
    """(objective, callback) for ``cfg.distill``, or (None, None) without teachers. Every
    teacher is loaded and checked here, before the first step."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.iiad.teacher_logits import OfflineTeacher

    d = cfg.distill
    if not d.teachers:
        return None, None
    teachers = []
    for i, section in enumerate(d.teachers):
        if section.checkpoint is not None:
            teachers.append(load_live_teacher(i, section, model_config, tokenizer.fingerprint))
        else:
            teachers.append(OfflineTeacher.open(
                section.logits, f"distill.teachers[{i}].logits", section.weight,
                section.name, train_dataset, tokenizer.fingerprint, model_config.vocab_size,
                cfg.schedule.train_steps * cfg.parallel.global_batch_size))
    _unique_names(teachers)
    objective = DistillationObjective(
        teachers, d.kl_weight, d.temperature, d.start_step, d.end_step, d.positions,
        pipelined=ps.get_pipeline_model_parallel_world_size() > 1)
    return objective, DistillationCallback(objective, cfg.logging.log_interval)
