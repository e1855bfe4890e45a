"""Checkpoints: one directory per save, written atomically, resumable bit for bit; which engine
wrote it does not matter here (each engine writes and reads its own state: engines.py).

Layout of a checkpoint root::

    latest                  text: the name of the newest complete checkpoint (updated last)
    iter_0000100/           one complete checkpoint
        meta.json           step, consumed samples, scheduler, engine, layout, config,
                            architecture, tokenizer, and the manifest (every file, its size
                            and checksum)
        (the engine's files: dist_checkpointing tensors, rng/rank{r}.pt, deepspeed/ ...)
    iter_0000200.partial/   a save in progress (or interrupted): never read, removed on start

`meta.json` is written last inside the directory, so a resume can tell a complete checkpoint
from a truncated one (`checkpoint_index.py`) and falls back to the newest complete one. Every
load (`verify_for_load`: resume, conversion, evaluation) first compares each file with its
checksum and reads the pickles megatron would unpickle without running code (`safe_pickle.py`).
Retention never deletes the checkpoint just saved, nor any newer one.
"""

from __future__ import annotations

import functools
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron.core.dist_checkpointing.core import CheckpointingException

from megatron_iiet.data.atomic import write_bytes_atomic
from megatron_iiet.distributed import all_gather, barrier, on_rank0, rank, world_size
from megatron_iiet.storage import storage_error
from megatron_iiet.training.checkpoint_index import (  # noqa: F401  (re-exported)
    CHECKSUMS_KEY, LATEST, MANIFEST_KEY, META, PARTIAL_SUFFIX, CheckpointError, checkpoint_name,
    checksum_record, checksums, list_checkpoints, manifest, newest_complete, read_meta,
    resolve_checkpoint, share, step_of, verify_checksums)
from megatron_iiet.training.checkpoint_meta import (  # noqa: F401  (re-exported)
    CheckpointMeta, architecture_signature, check_tokenizer, signature_differences, write_meta)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class TrainingState:
    """Everything besides tensors that a resume needs."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


class CheckpointManager:
    """Saves into one checkpoint root, which this run owns (the run lock is held).

    ``replaces``: complete checkpoints of an earlier run that this one was told to overwrite
    (``checkpoint.overwrite``); they are deleted once this run's first checkpoint is committed,
    so until then the directory still holds a resumable run.
    """

    def __init__(self, root: str, keep_last: int = 3, async_save: bool = False,
                 replaces: tuple[Path, ...] = (), log=print):
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.replaces = list(replaces)
        self.log = log
        self._async_queue = None
        if rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(f"iter_*{PARTIAL_SUFFIX}"):
                shutil.rmtree(stale, ignore_errors=True)  # an interrupted save of this directory
        barrier()

    # ---- saving ----------------------------------------------------------------------------
    def save(self, engine, state: TrainingState, meta_extra: dict) -> Path:
        """Write checkpoint ``state.step`` with ``engine.save`` and ``engine.state_meta()``;
        ``meta_extra`` (config, architecture signature, tokenizer) goes into its meta.json. It is
        committed (meta, rename, `latest`, retention) at once, or with ``async_save`` when the
        background write has finished."""
        name = checkpoint_name(state.step)
        final = self.root / name
        partial = self.root / (name + PARTIAL_SUFFIX)
        self.finalize_pending(blocking=True)
        try:
            if rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            barrier()
            request = engine.save(partial, self.async_save)
            meta = CheckpointMeta(**meta_extra, **engine.state_meta(), step=state.step,
                                  consumed_samples=state.consumed_samples,
                                  skipped_steps=state.skipped_steps)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is one
            raise self._failed(err, partial) from err
        commit = functools.partial(self._commit, meta, partial, final)
        if request is None:
            commit()
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request.add_finalize_fn(commit)
            if self._async_queue is None:
                self._async_queue = AsyncCallsQueue()
            self._async_queue.schedule_async_request(request)
            self._pending = partial
        return final

    def _commit(self, meta: CheckpointMeta, partial: Path, final: Path) -> None:
        barrier()  # every rank has written its files
        files = manifest(partial)
        try:  # each rank hashes a share of the files (the just-written bytes: page cache)
            mine: dict | OSError = checksums(partial, share(files, rank(), world_size()))
        except OSError as err:
            mine = err
        shares = all_gather(mine)
        on_rank0(lambda: self._publish(meta, partial, final, files, shares),
                 lambda err: self._failed(err, partial))
        self.log(f"saved checkpoint {final}")

    def _publish(self, meta: CheckpointMeta, partial: Path, final: Path, files: dict[str, int],
                 shares: list) -> None:
        sums: dict[str, str] = {}
        for part in shares:
            if isinstance(part, OSError):
                raise part
            sums.update(part)
        write_meta(partial, meta, sums)
        superseded = final.with_name(final.name + ".superseded")
        if final.exists():  # the same step saved again (after a resume from an older one)
            os.replace(final, superseded)
        os.replace(partial, final)
        _fsync_dir(self.root)
        write_bytes_atomic(self.root / LATEST, final.name.encode())
        shutil.rmtree(superseded, ignore_errors=True)
        self._retire(final)

    def _retire(self, saved: Path) -> None:
        """Retention: of the checkpoints older than the one just saved, keep the newest
        ``keep_last - 1`` (0 keeps all). Newer ones are never touched, except those this run
        was told to overwrite, which go at its first commit."""
        overwritten = [p for p in self.replaces if p != saved]
        self.replaces = []
        older = [p for p in list_checkpoints(self.root) if step_of(p) < step_of(saved)]
        pruned = older[: max(0, len(older) - (self.keep_last - 1))] if self.keep_last > 0 else []
        for path in pruned:
            shutil.rmtree(path)
        for path in overwritten:
            if path.exists():
                shutil.rmtree(path)
                self.log(f"removed {path.name} of the overwritten run (checkpoint.overwrite)")

    def _failed(self, err: BaseException, partial: Path) -> BaseException:
        """A storage fault becomes one line saying what survived; anything else is a bug."""
        fault = storage_error(err, self.root)
        if fault is None:
            return err
        shutil.rmtree(partial, ignore_errors=True)  # never committed: nothing saved is lost
        kept = newest_complete(self.root, warn=lambda _: None)
        survivor = f"{kept.name} and `latest` are intact" if kept else "no earlier checkpoint"
        return CheckpointError(
            f"{fault} while saving {partial.name[: -len(PARTIAL_SUFFIX)]}; {survivor}")

    def finalize_pending(self, blocking: bool = False) -> None:
        if self._async_queue is None:
            return
        try:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        except (CheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # as in save()
            raise self._failed(err, self._pending) from err

    def close(self) -> None:
        self.finalize_pending(blocking=True)
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None

    # ---- loading ---------------------------------------------------------------------------
    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (None in an empty root), warning about broken ones."""
        return newest_complete(self.root, warn=self.log)


# What a model-only start may change (two-stage training: a vanilla run continued as IIET):
# the step scheme around the same layer weights. What the new scheme adds (the history, PCformer's
# alpha) starts from its initialisation; weights the new scheme has no place for are refused.
MAPPABLE_DIFFERENCES = frozenset({"architecture", "formulation"})


def check_compatible(meta: CheckpointMeta, model_config, tokenizer_fingerprint: Optional[str],
                     path: Path, engine: str, model_only: bool = False) -> None:
    """Refuse checkpoints of another architecture, tokenizer or engine, naming the difference
    and, where there is one, the way to continue. Runs before the engine is built."""
    from megatron_iiet.training.engines import ENGINES, layout

    differences = signature_differences(meta.architecture or {}, model_config)
    diffs = [f"{k}: checkpoint {theirs!r} vs config {mine!r}"
             for k, (theirs, mine) in differences.items()]
    weights_only = model_only or meta.model_only
    if diffs and not (weights_only and set(differences) <= MAPPABLE_DIFFERENCES):
        hint = ("; a model-only start (checkpoint.init_from, or load_model_only) may take the "
                "weights of another architecture where they map"
                if set(differences) <= MAPPABLE_DIFFERENCES else "")
        raise CheckpointError(
            f"{path}: written by another architecture ({'; '.join(diffs)}){hint}")
    check_tokenizer(meta.tokenizer_fingerprint, tokenizer_fingerprint,
                    f"{path} (the configured data's tokenizer)")
    if model_only or meta.model_only:
        return
    saved_engine = meta.engine
    if saved_engine != engine:
        raise CheckpointError(
            f"{path}: written by the {saved_engine} engine, and this run uses "
            f"parallel.engine={engine}; their optimizer states are not interchangeable. Keep "
            f"parallel.engine={saved_engine} to resume, or set checkpoint.load_model_only=true "
            "to start from its weights with a fresh optimizer and schedule (step 0)")
    if ENGINES[engine].resume_needs_same_layout and meta.layout != layout():
        raise CheckpointError(
            f"{path}: {engine} state was saved with layout {meta.layout}; resuming it "
            f"needs the same layout, and this run has {layout()} (or set "
            "checkpoint.load_model_only=true for its weights only)")


def verify_for_load(path: Path, meta: Optional[CheckpointMeta] = None) -> None:
    """Before anything reads the checkpoint at ``path``: every file still has the checksum
    recorded at commit (the ranks split the hashing) and no pickle megatron reads names code
    (rank 0 reads them: `safe_pickle.check_dist_checkpoint`). Every rank raises the same
    one-line CheckpointError."""
    from megatron_iiet.safe_pickle import check_dist_checkpoint

    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    problem = verify_checksums(path, meta, rank(), world_size())
    if problem is None and rank() == 0:
        try:
            check_dist_checkpoint(path)
        except CheckpointError as err:
            problem = str(err)
    found = [p for p in all_gather(problem) if p]
    if found:
        raise CheckpointError(found[0])


def load(engine, path: Path, seed: int, model_only: bool = False, log=print,
         keep_position: bool = False) -> TrainingState:
    """Restore ``engine`` from the checkpoint at ``path`` (checked with ``check_compatible``
    first, its files with ``verify_for_load``); ``model_only`` (or a model-only checkpoint): the
    weights alone, also from another architecture (``MAPPABLE_DIFFERENCES``), at step 0 or,
    with ``keep_position``, at the checkpoint's step and sample position (fresh optimizer)."""
    meta = read_meta(path)
    verify_for_load(path, meta)
    if model_only or meta.model_only:
        other = signature_differences(meta.architecture or {}, engine.module.config)
        fresh = engine.load_weights(path, seed, mapped=bool(other))
        if fresh:
            log(f"took the {other['architecture'][0] if 'architecture' in other else 'saved'} "
                f"weights of {path}; {len(fresh)} weights of this architecture start from their "
                f"initialisation: {', '.join(_layer_patterns(fresh))}")
        if keep_position and not meta.model_only:
            if meta.scheduler:
                engine.scheduler.load_state_dict(meta.scheduler)  # the config's LR, at this step
            return TrainingState(meta.step, meta.consumed_samples, meta.skipped_steps)
        return TrainingState()
    try:
        engine.load(path, meta, seed)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, CheckpointingException) as err:
        # The manifest check passed, so the bytes changed in place: unreadable, not a bug here.
        raise CheckpointError(
            f"{path}: cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            "set checkpoint.load to an earlier iter_* directory") from err
    return TrainingState(meta.step, meta.consumed_samples, meta.skipped_steps)


def mapped_weights(sharded: dict, directory: Path) -> tuple[dict, list[str]]:
    """(the part of a model's sharded state dict the checkpoint at ``directory`` holds, the
    names of the rest). Refuses, naming them, checkpoint weights this model has no place for
    (on any rank) and shapes that differ."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    saved = {k: v for k, v in dist_checkpointing.load_tensors_metadata(str(directory)).items()
             if not k.startswith("optimizer.")}  # a full checkpoint's optimizer state stays
    kept, fresh, used = {}, [], set()
    for name, entry in sharded.items():
        key = getattr(entry, "key", None)
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            kept[name] = entry  # layers' extra state: the same megatron layers in both
            continue
        if isinstance(entry, ShardedTensorFactory):  # saved under key or key_w / key_v (SwiGLU)
            matches = [k for k in saved if k == key or k.startswith(key + "_")]
        else:
            matches = [key] if key in saved else []
            if matches and tuple(saved[key].global_shape) != tuple(entry.global_shape):
                raise CheckpointError(
                    f"{directory}: {key} has shape {tuple(saved[key].global_shape)} there and "
                    f"{tuple(entry.global_shape)} in this model")
        if matches:
            kept[name] = entry
            used.update(matches)
        else:
            fresh.append(name)
    everywhere = set().union(*all_gather(sorted(used)))
    unplaced = sorted(set(saved) - everywhere)
    if unplaced:
        raise CheckpointError(
            f"{directory}: {len(unplaced)} of its weights have no place in this model "
            f"({', '.join(_layer_patterns(unplaced)[:3])}); a model-only start can add what "
            "an architecture adds (vanilla into IIET), not drop weights")
    return kept, fresh


def _layer_patterns(names: list[str]) -> list[str]:
    """Names with their layer numbers folded (decoder.layers.*.history.pop_weight), in order."""
    import re

    return list(dict.fromkeys(re.sub(r"\.layers\.\d+\.", ".layers.*.", n) for n in names))
