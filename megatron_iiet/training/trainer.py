"""The training loop: one step is "next global batch -> engine.train_step -> bookkeeping"."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_iiet.training.config import TrainConfig, validate


@dataclass
class TrainSummary:
    steps: int
    params_sha256: str
    final_loss: Optional[float]
    valid_loss: Optional[float]
    checkpoint: Optional[str]
    log_dir: str
    preempted: bool


class TooManySkippedSteps(RuntimeError):
    pass


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    # A multiple of 128 whatever the TP size, so every layout shares one embedding shape.
    return -(-vocab_size // multiple) * multiple


def build_model_config(cfg: TrainConfig, vocab_size: int):
    from megatron_iiet.model.config import preset

    m, par = cfg.model, cfg.parallel
    overrides = {k: v for k, v in dataclasses.asdict(m).items() if k != "preset" and v is not None}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[par.precision]
    return preset(
        m.preset,
        **overrides,
        vocab_size=vocab_size,
        max_sequence_length=cfg.data.seq_length,
        tensor_model_parallel_size=par.tensor,
        pipeline_model_parallel_size=par.pipeline,
        params_dtype=dtype,
        bf16=par.precision == "bf16",
        fp16=par.precision == "fp16",
    )


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


def _resume_plan(cfg: TrainConfig, root: Path, say) -> tuple[Optional[Path], list]:
    """(checkpoint to load, checkpoints this run overwrites), decided on rank 0.

    A start below the newest complete checkpoint of ``root`` (a fresh start, a model-only load, a
    rollback) would, once saving, bury the newer run under its own: refused unless
    ``checkpoint.overwrite``, which names what goes and deletes it at the first commit.
    """
    from megatron_iiet.training import checkpoint_index as index

    load = cfg.checkpoint.load
    if load is None:
        path = None
    elif load == "auto":
        path = index.newest_complete(root, warn=say)
    else:
        path = index.resolve_checkpoint(load)
    start = 0
    if path is not None and not cfg.checkpoint.load_model_only:
        meta = index.read_meta(path)
        start = 0 if meta.get("model_only") else meta["step"]
    newer = index.newer_than(root, start)
    if newer.newer and not cfg.checkpoint.overwrite:
        raise index.CheckpointError(newer.message(root, start))
    return path, newer.newer


def train(cfg: TrainConfig) -> TrainSummary:
    from megatron_iiet.distributed import initialize, on_rank0
    from megatron_iiet.training.signals import PreemptionHandler

    par = cfg.parallel
    initialize(par.tensor, par.pipeline, seed=cfg.seed)
    if par.engine == "deepspeed":
        from megatron_iiet.training.engines import init_deepspeed_distributed

        init_deepspeed_distributed()
    validate(cfg, dist.get_world_size())
    # Installed first, so that every helper process started below leaves the signals to us.
    with PreemptionHandler() as preemption:
        locks = on_rank0(lambda: _lock_run_directories(cfg, dist.get_world_size()))
        try:
            return _train(cfg, preemption)
        finally:
            for lock in locks or ():
                lock.release()


def _train(cfg: TrainConfig, preemption) -> TrainSummary:
    from megatron.core import parallel_state

    from megatron_iiet.distributed import on_rank0
    from megatron_iiet.model.flops import step_flops
    from megatron_iiet.model.gpt import IIETModel
    from megatron_iiet.model.sharding import init_layout_independent
    from megatron_iiet.training import checkpointing as ckpt
    from megatron_iiet.training.data import build_datasets, micro_batch_loader, resolve_sources
    from megatron_iiet.training.engines import build_engine, optimizer_state_bytes
    from megatron_iiet.training.metrics import (
        MetricsLogger, Throughput, measured_peak_flops, memory_mb, optional_float)

    par = cfg.parallel
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()

    def say(text: str) -> None:  # rank 0's messages before the metrics logger exists
        if rank == 0:
            print(text, flush=True)

    # Everything that can be wrong with the inputs is found before the first step.
    sources = resolve_sources(cfg, rank)
    model_config = build_model_config(cfg, padded_vocab_size(sources.tokenizer.vocab_size))
    root = Path(cfg.checkpoint_dir)
    load_path, overwritten = on_rank0(lambda: _resume_plan(cfg, root, say))
    model_only = cfg.checkpoint.load_model_only
    if load_path is not None:
        ckpt.check_compatible(ckpt.read_meta(load_path), model_config,
                              sources.tokenizer.fingerprint, load_path, par.engine, model_only)
    train_ds, valid_ds = build_datasets(cfg, sources)
    manager = ckpt.CheckpointManager(str(root), cfg.checkpoint.keep_last,
                                     cfg.checkpoint.async_save, replaces=overwritten, log=say)

    model = IIETModel(model_config)
    init_layout_independent(model, cfg.seed)
    engine = build_engine(cfg, model)
    state = ckpt.TrainingState()
    load_seconds = None
    if load_path is not None:
        t0 = time.perf_counter()
        state = ckpt.load(engine, load_path, cfg.seed, model_only)
        load_seconds = time.perf_counter() - t0

    num_micro = par.global_batch_size // (par.micro_batch_size * dp)
    seq = cfg.data.seq_length
    flops = step_flops(model_config, par.global_batch_size, seq).model
    throughput = Throughput(flops, par.global_batch_size * seq,
                            measured_peak_flops(model_config.params_dtype), world)
    log = MetricsLogger(cfg.logging.dir, rank == 0, cfg.schedule.train_steps, state.step,
                        cfg.logging.tensorboard, cfg.logging.progress_bar)
    manager.log = log.message
    if load_path is not None:
        log.message(f"resumed from {load_path} at step {state.step}")
        log.event("resume", state.step, path=str(load_path), seconds=load_seconds)
    meta_extra = {"config": cfg.to_dict(), "tokenizer_fingerprint": sources.tokenizer.fingerprint,
                  "tokenizer": str(sources.tokenizer.path)}

    def save():
        t0 = time.perf_counter()
        path = manager.save(engine, state, meta_extra)
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if (
            rank == 0 and Path(path).exists()) else None
        log.event("checkpoint", state.step, path=str(path), seconds=seconds, bytes=size,
                  async_save=cfg.checkpoint.async_save)
        return path

    def evaluate() -> float:
        engine.train(False)
        batches = micro_batch_loader(valid_ds, 0, par.micro_batch_size, dp_rank, dp, 0)
        losses = [engine.eval_step([next(batches) for _ in range(num_micro)])
                  for _ in range(cfg.eval.steps)]
        engine.train(True)
        return sum(losses) / len(losses)

    batches = micro_batch_loader(train_ds, state.consumed_samples, par.micro_batch_size, dp_rank,
                                 dp, cfg.data.num_workers,
                                 total_samples=cfg.schedule.train_steps * par.global_batch_size)
    last_loss, valid_loss, valid_step, preempted = None, None, None, False
    saved, saved_step = load_path, (state.step if load_path is not None else None)
    engine.train(True)
    first_step = state.step
    exit_interval = cfg.schedule.exit_interval
    while state.step < cfg.schedule.train_steps:
        t0 = time.perf_counter()
        result = engine.train_step([next(batches) for _ in range(num_micro)])
        seconds = time.perf_counter() - t0
        state.step += 1
        state.consumed_samples += par.global_batch_size
        last_loss = result.loss
        if result.skipped:
            state.skipped_steps += 1
            log.message(f"step {state.step}: non-finite loss {result.loss}, update skipped "
                        f"({state.skipped_steps}/{cfg.logging.max_skipped_steps})")
        if result.skipped or state.step % cfg.logging.log_interval == 0 or state.step == 1:
            log.log_step(state.step, loss=result.loss, lr=result.lr,
                         grad_norm=optional_float(result.grad_norm),
                         skipped_steps=state.skipped_steps, **throughput(seconds),
                         optimizer_state_mb=optimizer_state_bytes(engine.optimizer) / 2**20,
                         **memory_mb())
        if state.skipped_steps > cfg.logging.max_skipped_steps:
            log.close()
            raise TooManySkippedSteps(
                f"{state.skipped_steps} steps with non-finite loss (limit "
                f"logging.max_skipped_steps={cfg.logging.max_skipped_steps})")
        if cfg.eval.interval and state.step % cfg.eval.interval == 0:
            valid_loss, valid_step = evaluate(), state.step
            log.log_eval(state.step, valid_loss)
        manager.finalize_pending()
        preempted = preemption.stop_requested()
        exiting = bool(exit_interval) and state.step - first_step >= exit_interval
        interval = cfg.checkpoint.save_interval
        if preempted or exiting or (interval and state.step % interval == 0):
            saved, saved_step = save(), state.step
        if preempted:
            log.message(f"preemption: {preemption.reason}; stopped after step {state.step}")
            log.event("preempted", state.step, reason=preemption.reason)
            break
        if exiting:
            log.message(f"schedule.exit_interval: stopped after step {state.step}")
            break
    finished = state.step >= cfg.schedule.train_steps
    if finished:
        if saved_step != state.step:
            saved, saved_step = save(), state.step
        if valid_step != state.step:
            valid_loss = evaluate()
            log.log_eval(state.step, valid_loss)
    manager.close()
    digest = parameters_sha256(model)
    log.event("end", state.step, params_sha256=digest, finished=finished, preempted=preempted)
    log.close()
    return TrainSummary(state.step, digest, last_loss, valid_loss,
                        str(saved) if saved else None, cfg.logging.dir, preempted)


def parameters_sha256(model) -> str:
    """A digest of the full (gathered) parameters: equal digests mean bitwise-equal models."""
    import hashlib

    from megatron_iiet.model.sharding import gather_full

    full = gather_full(model, dict(model.named_parameters()))
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
