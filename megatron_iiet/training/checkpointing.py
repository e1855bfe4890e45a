"""Checkpoints: megatron-core dist_checkpointing, written atomically, resumable bit for bit.

Layout of a checkpoint root::

    latest                  text: the name of the newest complete checkpoint (updated last)
    iter_0000100/           one complete checkpoint
        meta.json           step, consumed samples, scheduler, config, architecture, tokenizer
        (dist_checkpointing files: model, optimizer of the megatron engine)
        rng/rank{r}.pt      every rank's RNG streams (torch, megatron's tracker, CUDA)
        deepspeed/          DeepSpeed engine state (ZeRO partitions), deepspeed engine only
    iter_0000200.partial/   a save in progress (or interrupted): never read, removed on start

Model and optimizer tensors are keyed by global names, so a checkpoint written with one TP/PP
layout loads into another (reshard). RNG streams belong to a layout: after a reshard they are
re-seeded deterministically from (seed, step) instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from megatron_iiet.distributed import barrier

LATEST = "latest"
META = "meta.json"
PARTIAL_SUFFIX = ".partial"


class CheckpointError(ValueError):
    pass


def architecture_signature(model_config) -> dict:
    """What must match for weights to mean the same thing."""
    c = model_config
    return {
        "architecture": c.architecture,
        "formulation": c.formulation if c.architecture == "iiet" else None,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_query_groups": c.num_query_groups,
        "ffn_hidden_size": c.ffn_hidden_size,
        "vocab_size": c.vocab_size,
        "share_embeddings_and_output_weights": c.share_embeddings_and_output_weights,
    }


def layout() -> dict:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainingState:
    """Everything besides tensors that a resume needs."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


class CheckpointManager:
    def __init__(self, root: str, keep_last: int = 3, async_save: bool = False):
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._async_queue = None
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"iter_*{PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)  # an interrupted save
        barrier()

    # ---- saving ----------------------------------------------------------------------------
    def save(self, engine, state: TrainingState, meta_extra: dict) -> Path:
        rng = rng_state()  # before anything below could draw from a generator
        name = f"iter_{state.step:07d}"
        final = self.root / name
        partial = self.root / (name + PARTIAL_SUFFIX)
        self.finalize_pending(blocking=True)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        barrier()

        model = engine.module
        with engine.full_parameters():
            sharded = {"model": model.sharded_state_dict()}
            if engine.name == "megatron":
                sharded["optimizer"] = engine.optimizer.sharded_state_dict(sharded["model"])
            request = dist_checkpointing.save(sharded, str(partial),
                                              async_sharded_save=self.async_save)
        (partial / "rng").mkdir(exist_ok=True)
        torch.save(rng, partial / "rng" / f"rank{_rank()}.pt")
        if engine.name == "deepspeed":
            engine.model.save_checkpoint(str(partial / "deepspeed"), tag="state",
                                         save_latest=False)
        meta = {
            **meta_extra,
            "step": state.step,
            "consumed_samples": state.consumed_samples,
            "skipped_steps": state.skipped_steps,
            "scheduler": engine.scheduler.state_dict(),
            "architecture": architecture_signature(model.config),
            "layout": layout(),
            "engine": engine.name,
        }

        def commit():
            _fault_injection_pause(partial)
            barrier()
            if _rank() == 0:
                _write_text_atomic(partial / META, json.dumps(meta, indent=2, default=str))
                superseded = final.with_name(final.name + ".superseded")
                if final.exists():  # the same step saved again (e.g. after an earlier resume)
                    os.replace(final, superseded)
                os.replace(partial, final)
                _fsync_dir(self.root)
                _write_text_atomic(self.root / LATEST, name)
                shutil.rmtree(superseded, ignore_errors=True)
                self._prune()
            barrier()

        if request is None:
            commit()
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request.add_finalize_fn(commit)
            if self._async_queue is None:
                self._async_queue = AsyncCallsQueue()
            self._async_queue.schedule_async_request(request)
        return final

    def finalize_pending(self, blocking: bool = False) -> None:
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        self.finalize_pending(blocking=True)
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("iter_???????") if p.is_dir())
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- loading ---------------------------------------------------------------------------
    def latest(self) -> Optional[Path]:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / META).is_file():
            raise CheckpointError(f"{pointer}: points to {path}, which is not a complete checkpoint")
        return path


def _fault_injection_pause(partial: Path) -> None:
    """Tests of interrupted saves set IIET_TEST_PAUSE_IN_SAVE=<marker file>: the first save
    announces itself there and waits, so a signal can arrive while the checkpoint is half
    written."""
    marker = os.environ.get("IIET_TEST_PAUSE_IN_SAVE")
    if marker and _rank() == 0 and not Path(marker).exists():
        import time

        Path(marker).write_text(str(partial))
        time.sleep(float(os.environ.get("IIET_TEST_PAUSE_SECONDS", "5")))


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory from a root (via its `latest`) or from an iter_* path."""
    p = Path(path)
    if (p / META).is_file():
        return p
    if (p / LATEST).is_file():
        target = p / (p / LATEST).read_text().strip()
        if (target / META).is_file():
            return target
    raise CheckpointError(f"{path}: not a checkpoint (no {META}, no {LATEST} pointer)")


def read_meta(path: Path) -> dict:
    return json.loads((path / META).read_text())


def check_compatible(meta: dict, model_config, tokenizer_fingerprint: Optional[str],
                     path: Path) -> None:
    """Refuse checkpoints of another architecture or tokenizer, naming the difference."""
    mine = architecture_signature(model_config)
    theirs = meta.get("architecture", {})
    diffs = [f"{k}: checkpoint {theirs.get(k)!r} vs config {v!r}"
             for k, v in mine.items() if theirs.get(k) != v]
    if diffs:
        raise CheckpointError(f"{path}: written by another architecture ({'; '.join(diffs)})")
    saved_fp = meta.get("tokenizer_fingerprint")
    if tokenizer_fingerprint and saved_fp and saved_fp != tokenizer_fingerprint:
        raise CheckpointError(
            f"{path}: trained with tokenizer {saved_fp}, but the configured data uses "
            f"{tokenizer_fingerprint}")


def load(engine, path: Path, seed: int) -> TrainingState:
    """Restore model, optimizer, scheduler and RNG from ``path`` into ``engine``."""
    meta = read_meta(path)
    if meta.get("model_only"):
        return _load_model_only(engine, path, seed)
    same_layout = meta["layout"] == layout() and meta.get("engine") == engine.name
    if engine.name == "deepspeed":
        if not same_layout:
            raise CheckpointError(
                f"{path}: DeepSpeed state was saved with layout {meta['layout']} "
                f"({meta.get('engine')} engine); resuming it needs the same layout {layout()} "
                "and engine")
        # module and ZeRO-partitioned optimizer state, in DeepSpeed's own format
        engine.model.load_checkpoint(str(path / "deepspeed"), tag="state",
                                     load_module_strict=True, load_optimizer_states=True,
                                     load_lr_scheduler_states=False)
    else:
        if meta.get("engine") != "megatron":
            raise CheckpointError(
                f"{path}: written by the {meta.get('engine')} engine; its optimizer state "
                "cannot continue under parallel.engine=megatron")
        model_sd = engine.module.sharded_state_dict()
        loaded = dist_checkpointing.load(
            {"model": model_sd,
             "optimizer": engine.optimizer.sharded_state_dict(model_sd, is_loading=True)},
            str(path))
        engine.module.load_state_dict(loaded["model"])
        engine.optimizer.load_state_dict(loaded["optimizer"])
    engine.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank{_rank()}.pt"
    if same_layout and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        from megatron_iiet.distributed import seed_everything

        seed_everything(seed + meta["step"])
    return TrainingState(meta["step"], meta["consumed_samples"], meta.get("skipped_steps", 0))


def _load_model_only(engine, path: Path, seed: int) -> TrainingState:
    """Weights only (e.g. converted from HF by tools/convert_checkpoint.py): the optimizer and
    schedule start fresh, at step 0."""
    from megatron_iiet.distributed import seed_everything

    with engine.full_parameters(modify=True):
        loaded = dist_checkpointing.load({"model": engine.module.sharded_state_dict()}, str(path))
        engine.module.load_state_dict(loaded["model"])
    # Optimizers holding fp32 master copies (bf16/fp16, ZeRO partitions) built them from the
    # initial weights: refresh them from the loaded ones.
    if engine.name == "megatron":
        engine.optimizer.reload_model_params()
    elif hasattr(engine.model.optimizer, "refresh_fp32_params"):
        engine.model.optimizer.refresh_fp32_params()
    seed_everything(seed)
    return TrainingState()
