"""A run assembled from its config: process groups, run locks, data, model, engine, resume point,
and the callbacks of every feature (training's own, in-loop task evaluation from ``eval``,
distillation from ``iiad``). It sits above those packages, so ``training/`` imports none of them;
``Trainer.fit`` (training/trainer.py) is the loop it hands over to.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_iiet.errors import BadInput
from megatron_iiet.training.callbacks import (  # noqa: F401  (TooManySkippedSteps re-exported)
    Callback, CheckpointCallback, CheckpointRecords, ExitDurationCallback, ExitIntervalCallback,
    MetricsCallback, NonFiniteCallback, PreemptionCallback, TooManySkippedSteps,
    ValidationCallback)
from megatron_iiet.training.config import (
    TrainConfig, build_model_config, padded_vocab_size, validate)
from megatron_iiet.training.trainer import Trainer, TrainSummary


def _lock_run_directories(cfg: TrainConfig, world: int) -> list:
    """Rank 0 takes the run lock of the logging and checkpoint directories (two jobs writing
    one directory would delete each other's saves and interleave their metrics)."""
    from megatron_iiet.locks import describe, directory_lock

    dirs = dict.fromkeys(str(Path(d).resolve()) for d in (cfg.logging.dir, cfg.checkpoint_dir))
    locks = []
    try:
        for directory in dirs:
            locks.append(directory_lock(directory, f"pretrain_iiet.py ({world} ranks)").acquire())
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    for lock in locks:
        if lock.replaced_stale is not None:
            print(f"replaced the stale lock of a dead job ({describe(lock.replaced_stale)}) "
                  f"in {lock.path.parent}", flush=True)
    return locks


def _resume_plan(cfg: TrainConfig, root: Path, say) -> tuple[Optional[Path], list, bool, bool]:
    """(checkpoint to load, checkpoints this run overwrites, weights only?, is it init_from?),
    decided on rank 0.

    ``checkpoint.init_from`` is the start of a run that has no checkpoint of its own yet (a
    student initialised from its IIET); once it has saved, ``load: auto`` resumes it instead.

    A start below the newest complete checkpoint of ``root`` (a fresh start, a model-only load, a
    rollback) would, once saving, bury the newer run under its own: refused unless
    ``checkpoint.overwrite``, which names what goes and deletes it at the first commit.
    """
    from megatron_iiet.training import checkpoint_index as index

    load = cfg.checkpoint.load
    model_only = cfg.checkpoint.load_model_only
    from_init = False
    if load is None:
        path = None
    elif load == "auto":
        path = index.newest_complete(root, warn=say)
        if path is None and cfg.checkpoint.init_from is not None:
            path, model_only = index.resolve_checkpoint(cfg.checkpoint.init_from), True
            from_init = True
            say(f"checkpoint.init_from: starting from the weights of {path}")
    else:
        path = index.resolve_checkpoint(load)
    start = 0
    if path is not None and not model_only:
        meta = index.read_meta(path)
        start = 0 if meta.model_only else meta.step
    newer = index.newer_than(root, start)
    if newer.newer and not cfg.checkpoint.overwrite:
        raise index.CheckpointError(newer.message(root, start))
    return path, newer.newer, model_only, from_init


def train(cfg: TrainConfig, objective=None, callbacks: tuple[Callback, ...] = ()) -> TrainSummary:
    """Train as ``cfg`` says; ``objective`` replaces the language-model loss (step.Objective),
    ``callbacks`` run after the built-in ones."""
    from megatron_iiet.distributed import initialize, on_rank0
    from megatron_iiet.platform import cpu_denormals_flushed
    from megatron_iiet.training.signals import PreemptionHandler
    from megatron_iiet.training.watchdog import collective_timeout_s

    started = time.monotonic()  # schedule.exit_duration_minutes counts the set-up too
    # Only OperatorErrors (BadInput, CheckpointError, ...) become one line: the input checks
    # raise them, so a ValueError from torch or megatron is a bug and keeps its traceback.
    par = cfg.parallel
    initialize(par.tensor, par.pipeline, seed=cfg.seed,
               timeout_s=collective_timeout_s(par.stall_timeout_s, par.collective_timeout_s))
    if par.engine == "deepspeed":
        from megatron_iiet.training.engines import init_deepspeed_distributed

        init_deepspeed_distributed()
    validate(cfg, dist.get_world_size())
    # Installed first, so that every helper process started below leaves the signals to us.
    with PreemptionHandler() as preemption, cpu_denormals_flushed(par.flush_denormals):
        locks = on_rank0(lambda: _lock_run_directories(cfg, dist.get_world_size()))
        locks = locks if dist.get_rank() == 0 else ()  # the others got copies: rank 0 holds them
        try:
            return build_trainer(cfg, preemption, objective, list(callbacks), started).fit()
        finally:
            for lock in locks:
                lock.release()


def named_callbacks(specs: dict[str, dict]) -> list[Callback]:
    """The config's ``callbacks`` section built: each entry's class imported and called with
    the entry's other keys. Anything that does not resolve is the operator's, in one line."""
    import importlib

    built = []
    for name, spec in specs.items():
        kwargs = dict(spec)
        target = kwargs.pop("class")
        module_name, _, attr = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise BadInput(f"callbacks.{name}.class: cannot import {target} ({err})") from None
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise BadInput(f"callbacks.{name}.class: {target} is not a "
                           "megatron_iiet.training.callbacks.Callback subclass")
        try:
            built.append(cls(**kwargs))
        except TypeError as err:
            raise BadInput(f"callbacks.{name}: {target} does not take {kwargs} ({err})") from None
    return built


def build_trainer(cfg: TrainConfig, preemption, objective=None,
                  extra_callbacks: Optional[list[Callback]] = None,
                  started: Optional[float] = None) -> Trainer:
    """The trainer with every configured part; ``started`` (time.monotonic) is when the run
    began, for ``schedule.exit_duration_minutes`` (default: now)."""
    from megatron.core import parallel_state

    from megatron_iiet.data.prepare import builtin_corpus
    from megatron_iiet.distributed import on_rank0
    from megatron_iiet.eval.callback import task_evaluation
    from megatron_iiet.iiad.distill import build_distillation
    from megatron_iiet.model.flops import step_flops
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training import checkpointing as ckpt
    from megatron_iiet.training.data import (
        ORDER_VERSION, build_datasets, micro_batch_loader, resolve_sources)
    from megatron_iiet.training.resume import resume_point, samples_needed
    from megatron_iiet.training.engines import build_engine, current_lr
    from megatron_iiet.training.metrics import MetricsLogger, Throughput, measured_peak_flops

    par = cfg.parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()

    def say(text: str) -> None:  # rank 0's messages before the metrics logger exists
        if rank == 0:
            print(text, flush=True)

    # Everything that can be wrong with the inputs is found before the first step.
    sources = resolve_sources(cfg, builtin_corpus(cfg.data, rank))
    model_config = build_model_config(cfg, padded_vocab_size(sources.tokenizer.vocab_size))
    root = Path(cfg.checkpoint_dir)
    load_path, overwritten, model_only, from_init = on_rank0(
        lambda: _resume_plan(cfg, root, say))
    saved_meta = ckpt.read_meta(load_path) if load_path is not None else None
    if saved_meta is not None:
        ckpt.check_compatible(saved_meta, model_config,
                              sources.tokenizer.fingerprint, load_path, par.engine, model_only)
    keep_position = from_init and cfg.checkpoint.init_from_position
    resume_at = resume_point(saved_meta, cfg, model_only, load_path, keep_position)
    task_callback = task_evaluation(cfg, sources.tokenizer, preemption)
    configured = named_callbacks(cfg.callbacks)
    total_samples = samples_needed(cfg, resume_at)
    train_ds, valid_ds = build_datasets(cfg, sources, total_samples, resume_at.legacy_order)
    manager = ckpt.CheckpointManager(str(root), cfg.checkpoint.keep_last,
                                     cfg.checkpoint.async_save, replaces=overwritten, log=say)

    distill_objective, distill_callback = build_distillation(cfg, model_config,
                                                             sources.tokenizer, train_ds)
    if distill_objective is not None:
        if objective is not None:
            raise BadInput("distill: this run was given its own objective; a distill: section "
                           "would replace it (leave one of the two)")
        objective = distill_objective

    # megatron builds its parallel layers on the GPU but plain torch modules (norms, the history)
    # on the CPU; Megatron-LM's get_model moves the whole model likewise
    model = IIETGPTModel(model_config).to(compute_device())
    init_layout_independent(model, cfg.seed)
    engine = build_engine(cfg, model, objective)
    state = ckpt.TrainingState()
    load_seconds = None
    if load_path is not None:
        t0 = time.perf_counter()
        state = ckpt.load(engine, load_path, cfg.seed, model_only, log=say,
                          keep_position=keep_position)
        load_seconds = time.perf_counter() - t0

    reporter = MetricsLogger(cfg.logging.dir, rank == 0, cfg.schedule.train_steps, state.step,
                             cfg.logging.tensorboard, cfg.logging.progress_bar, cfg.logging,
                             cfg.to_dict())
    manager.log = reporter.message
    if load_path is not None:
        reporter.message(
            f"took the weights of {load_path} and its position, step {state.step} (fresh "
            "optimizer)" if keep_position else
            f"took the weights of {load_path} (fresh optimizer and schedule)" if model_only
            else f"resumed from {load_path} at step {state.step}")
        reporter.event("resume", state.step, path=str(load_path), seconds=load_seconds,
                       model_only=model_only, config_changes=resume_at.changes)
        if resume_at.changes:
            reporter.message("applied since the checkpoint: " + "; ".join(resume_at.changes)
                             + f" (lr at step {state.step} now "
                             f"{current_lr(engine.optimizer):.3g})")

    num_micro = par.global_batch_size // (par.micro_batch_size * dp)
    micro = micro_batch_loader(train_ds, state.consumed_samples, par.micro_batch_size, dp_rank,
                               dp, cfg.data.num_workers,
                               total_samples=total_samples)

    def batches():
        try:
            while True:  # the loop stops at train_steps; the sampler is sized for exactly that
                yield [next(micro) for _ in range(num_micro)]
        finally:
            micro.close()  # releases the loader, whose workers then exit

    def evaluate() -> Optional[float]:
        valid = micro_batch_loader(valid_ds, 0, par.micro_batch_size, dp_rank, dp, 0)
        losses = []
        for _ in range(cfg.eval.steps):
            # A long validation would outlast the launcher's grace period (torchrun: 30 s)
            # and lose the save a preemption signal asks for: give way at once.
            if preemption.stop_requested():
                return None
            losses.append(engine.eval_step([next(valid) for _ in range(num_micro)]))
        return sum(losses) / len(losses)

    seq = cfg.data.seq_length
    throughput = Throughput(step_flops(model_config, par.global_batch_size, seq).model,
                            par.global_batch_size * seq,
                            measured_peak_flops(model_config.params_dtype), world)
    callbacks: list[Callback] = [
        MetricsCallback(cfg.logging.log_interval, throughput),
        NonFiniteCallback(cfg.logging.max_skipped_steps),
        ValidationCallback(cfg.eval.interval),
        PreemptionCallback(preemption),
    ]
    if par.stall_timeout_s:
        from megatron_iiet.training.watchdog import StallWatchdog

        callbacks.append(StallWatchdog(par.stall_timeout_s, Path(cfg.logging.dir) / "heartbeats"))
    if cfg.schedule.exit_interval:
        callbacks.append(ExitIntervalCallback(cfg.schedule.exit_interval))
    if cfg.schedule.exit_duration_minutes:
        callbacks.append(ExitDurationCallback(
            cfg.schedule.exit_duration_minutes,
            time.monotonic() if started is None else started))
    callbacks += [CheckpointRecords(cfg.checkpoint.async_save),
                  CheckpointCallback(manager, cfg.checkpoint.save_interval,
                                     state.step if load_path is not None else None),
                  *([task_callback] if task_callback else []),
                  *([distill_callback] if distill_callback else []), *configured,
                  *(extra_callbacks or ())]
    meta_extra = {"config": cfg.to_dict(), "tokenizer_fingerprint": sources.tokenizer.fingerprint,
                  "tokenizer": str(Path(sources.tokenizer.path).resolve()),
                  "architecture": ckpt.architecture_signature(model_config),
                  **({} if resume_at.legacy_order else {"data_order": ORDER_VERSION})}
    return Trainer(engine, state, batches(), evaluate, reporter, callbacks,
                   cfg.schedule.train_steps, par.global_batch_size, meta_extra,
                   checkpoint=str(load_path) if load_path is not None else None)
