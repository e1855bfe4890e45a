"""Two ways to own the optimizer, one interface for the training loop.

``MegatronEngine``: megatron-core's DistributedDataParallel and optimizer (its distributed
optimizer on GPU), micro-batches through megatron's schedules (1F1B with PP).
``DeepSpeedEngine``: DeepSpeed's ZeRO 1/2/3 (optional CPU offload of optimizer state) around the
same megatron-core TP model, PP=1. DeepSpeed's own activation checkpointing is never enabled:
recompute is ours (per pass / per layer), configured on the model.

Both use the same parameter groups (no weight decay on vectors), the same AdamW arithmetic and
megatron's OptimizerParamScheduler, so they follow the same trajectory.

Each engine owns its state: ``save(directory)`` writes weights, optimizer and every rank's RNG
streams, ``state_meta()`` what goes into the checkpoint's metadata (scheduler, engine, layout),
``load(directory, meta)`` restores all of it and ``load_weights(directory)`` the weights alone.
Weights are always megatron-core dist_checkpointing tensors under global names, so any engine
and layout can read another's weights; optimizer state is each engine's own format.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_iiet import platform
from megatron_iiet.training.config import TrainConfig
from megatron_iiet.training.step import (
    LANGUAGE_MODEL, Objective, allreduce_cross_stage_grads, forward_backward)


@dataclass
class StepResult:
    loss: float  # mean over the global batch (every rank gets it)
    grad_norm: Optional[float]
    skipped: bool  # non-finite loss: no update was applied
    lr: float
    terms: dict[str, float] = field(default_factory=dict)  # the objective's terms, when several


def _global_means(metrics: list[dict], names: list[str]) -> dict[str, float]:
    """Mean over micro-batches and the data-parallel group of each metric, known to every rank
    (only the last pipeline stage has them)."""
    reporting = parallel_state.is_pipeline_last_stage() and metrics
    sums = [sum(m[n] for m in metrics) / len(metrics) if reporting else 0.0 for n in names]
    t = torch.tensor([*sums, 1.0 if reporting else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return {n: (t[i] / t[-1]).item() for i, n in enumerate(names)}


def layout() -> dict:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def rng_state() -> dict:
    """This rank's generators as tensors and plain values only, so that a resume reads them
    with ``torch.load(weights_only=True)`` (a pickled object could run code when read)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),  # (int, tuple of ints, float or None)
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)),
        "torch": torch.get_rng_state(),
        # cudagraph-safe trackers keep torch.Generator objects: their state is a tensor
        "tracker": {name: s.get_state() if isinstance(s, torch.Generator) else s
                    for name, s in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if platform.cuda_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys  # ndarray in files before tensors
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    for name, saved in state["tracker"].items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(saved)
        else:
            current[name] = saved
    tracker.set_states(current)
    if "cuda" in state and platform.cuda_available():
        torch.cuda.set_rng_state(state["cuda"])


# Checkpoints written before RNG files held tensors only pickled numpy's key array: the globals
# rebuilding a plain uint32 array are the whole exception (torch's documented recipe).
_LEGACY_RNG_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                       np.dtypes.UInt32DType]


def read_rng_state(path: Path) -> dict:
    """The RNG streams saved in ``path``, read with ``weights_only=True``: a file holding
    anything else is a CheckpointError naming it, and nothing in it runs."""
    from megatron_iiet.safe_pickle import load_data

    with torch.serialization.safe_globals(_LEGACY_RNG_GLOBALS):
        return load_data(path, path)


def _rng_file(directory: Path) -> Path:
    from megatron_iiet.distributed import rank

    return Path(directory) / "rng" / f"rank{rank()}.pt"


class RewarmedScheduler(OptimizerParamScheduler):
    """The schedule with a second linear warm-up: over the ``steps`` updates after step ``start``
    the LR ramps from 0 to the schedule's value. A fresh optimizer started mid-schedule (the
    second stage of two-stage training) would otherwise take its first updates at the full LR
    from second-moment estimates of a few batches. A pure function of the step, so a resume
    inside the ramp continues it."""

    def __init__(self, optimizer, *, rewarmup: tuple[int, int], **kwargs):
        self.rewarmup = rewarmup  # before super().__init__, whose step(0) sets the first LR
        super().__init__(optimizer, **kwargs)

    def get_lr(self, param_group: dict) -> float:
        start, steps = self.rewarmup
        into = self.num_steps - start
        scale = into / steps if 0 < into < steps else 1.0
        return super().get_lr(param_group) * scale


def build_scheduler(cfg: TrainConfig, optimizer) -> OptimizerParamScheduler:
    """The config's schedule. On resume only the step count comes from the checkpoint: a changed
    schedule or LR takes effect, evaluated at the current step (as Megatron-LM's
    --override-opt_param-scheduler and torchtitan's LR lambdas do), instead of megatron's default
    of silently keeping the saved one."""
    s, o = cfg.schedule, cfg.optimizer
    rewarmup = {} if s.rewarmup_from is None else {"rewarmup": (s.rewarmup_from, s.rewarmup_steps)}
    return (RewarmedScheduler if rewarmup else OptimizerParamScheduler)(
        optimizer, **rewarmup,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=s.train_steps,
        lr_decay_style=s.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=s.train_steps,
        wd_incr_style="constant",
        wsd_decay_steps=s.wsd_decay_steps,
        lr_wsd_decay_style=s.wsd_decay_style,
    )


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _advance_schedule(scheduler, optimizer) -> float:
    """Set the learning rate of the update about to happen: update k (1-based) uses the
    schedule's value at k, so warm-up never spends its first step at lr 0."""
    scheduler.step(increment=1)
    return current_lr(optimizer)


def _inner_torch_optimizers(optimizer):
    """The torch optimizers under megatron's / DeepSpeed's wrappers (chained or nested)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for child in getattr(optimizer, "chained_optimizers", None) or [getattr(optimizer, "optimizer", None)]:
        if child is not None and child is not optimizer:
            found += _inner_torch_optimizers(child)
    return found


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (moments; ZeRO shards them over DP)."""
    total = 0
    for opt in _inner_torch_optimizers(optimizer):
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.numel() > 1:
                    total += v.numel() * v.element_size()
    return total


class Engine:
    """What both engines share: the schedule, the objective, the RNG and the state protocol."""

    name: str
    resume_needs_same_layout = False  # optimizer state partitioned by the layout (ZeRO)

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 objective: Optional[Objective] = None):
        self.module = model
        self.objective = objective or LANGUAGE_MODEL

    # ---- state: subclasses write / read their tensors -------------------------------------
    def _save_tensors(self, directory: Path, async_save: bool):
        raise NotImplementedError

    def _load_tensors(self, directory: Path) -> None:
        raise NotImplementedError

    def _refresh_master_params(self) -> None:
        """Optimizers holding fp32 master copies (bf16/fp16, ZeRO partitions) built them from
        the initial weights: take them again from the loaded ones."""
        raise NotImplementedError

    def save(self, directory: Path, async_save: bool = False):
        """Write weights, optimizer and this rank's RNG streams into ``directory``; returns
        megatron's async request when ``async_save`` (the tensors are still being written)."""
        rng = rng_state()  # before anything below could draw from a generator
        request = self._save_tensors(Path(directory), async_save)
        _rng_file(directory).parent.mkdir(exist_ok=True)
        torch.save(rng, _rng_file(directory))
        return request

    def state_meta(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "layout": layout(), "engine": self.name}

    def load(self, directory: Path, meta, seed: int) -> None:
        """Everything ``save`` wrote and ``state_meta`` recorded. RNG streams belong to a
        layout: after a reshard they are re-seeded from (seed, step) instead."""
        self._load_tensors(Path(directory))
        self.scheduler.load_state_dict(meta.scheduler)
        rng_file = _rng_file(directory)
        if meta.layout == layout() and rng_file.is_file():
            set_rng_state(read_rng_state(rng_file))
        else:
            from megatron_iiet.distributed import seed_everything

            seed_everything(seed + meta.step)

    def load_weights(self, directory: Path, seed: int, mapped: bool = False) -> list[str]:
        """The weights alone (any engine's checkpoint, or a converted one): optimizer and
        schedule stay fresh. ``mapped``: the checkpoint is another architecture's, and the
        weights it lacks keep their initialisation; returns their names."""
        from megatron_iiet.distributed import seed_everything
        from megatron_iiet.training.checkpointing import mapped_weights

        with self.full_parameters(modify=True):
            sharded, fresh = self.module.sharded_state_dict(), []
            if mapped:
                sharded, fresh = mapped_weights(sharded, directory)
            loaded = dist_checkpointing.load({"model": sharded}, str(directory))
            result = self.module.load_state_dict(loaded["model"], strict=not mapped)
            if mapped and (result.unexpected_keys or set(result.missing_keys) != set(fresh)):
                raise RuntimeError(f"mapped load of {directory}: missing {result.missing_keys}, "
                                   f"unexpected {result.unexpected_keys}, expected {fresh}")
        self._refresh_master_params()
        seed_everything(seed)
        return fresh

    def full_parameters(self, modify: bool = False):
        """Parameters are whole on their rank unless an engine partitions them."""
        return contextlib.nullcontext()

    def parameters_digest(self) -> str:
        """sha256 of the full (gathered) parameters: equal digests, bitwise-equal models."""
        from megatron_iiet.model.sharding import parameters_sha256

        with self.full_parameters():
            return parameters_sha256(self.module)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's parameters' gradients by local name, as the optimizer is about to see
        them (reduced, not clipped): valid in ``Callback.on_before_optimizer_step``."""
        from megatron_iiet.model.sharding import grads_of

        return grads_of(self.module)

    def _means(self, metrics: list[dict]) -> tuple[float, dict]:
        """(loss, the objective's other terms): each the mean over micro-batches and ranks."""
        means = _global_means(metrics, self.objective.metric_names)
        return means.pop("loss"), means


class MegatronEngine(Engine):
    name = "megatron"

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 objective: Optional[Objective] = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        super().__init__(cfg, model, objective)
        par, opt = cfg.parallel, cfg.optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=par.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config,
                                             module=model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
                clip_grad=opt.clip_grad, bf16=par.precision == "bf16",
                fp16=par.precision == "fp16", params_dtype=model.config.params_dtype,
                use_distributed_optimizer=par.use_distributed_optimizer,
            ),
            [self.model],
        )
        self.scheduler = build_scheduler(cfg, self.optimizer)

        def finalize(models, num_tokens=None, **kwargs):
            finalize_model_grads(models, num_tokens, **kwargs)
            allreduce_cross_stage_grads(models, embeddings=False)

        model.config.no_sync_func = self.model.no_sync
        model.config.finalize_model_grads_func = finalize

    def train_step(self, micro_batches: list[dict],
                   before_optimizer_step: Callable[[], None] = lambda: None) -> StepResult:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss, terms = self._means(forward_backward(self.model, micro_batches,
                                                   objective=self.objective))
        if not math.isfinite(loss):
            return StepResult(loss, None, True, current_lr(self.optimizer), terms)
        before_optimizer_step()  # reduced by the schedule's finalize_model_grads; clipped in step
        lr = _advance_schedule(self.scheduler, self.optimizer)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # fp16 overflow: no update, so the schedule does not advance either
            self.scheduler.step(increment=-1)
            return StepResult(loss, None, True, lr, terms)
        return StepResult(loss, grad_norm, False, lr, terms)

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> float:
        return self._means(forward_backward(self.model, micro_batches, forward_only=True,
                                            objective=self.objective))[0]

    # ---- state -------------------------------------------------------------------------------
    def _sharded(self, loading: bool = False) -> dict:
        model_sd = self.module.sharded_state_dict()
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading)}

    def _save_tensors(self, directory: Path, async_save: bool):
        return dist_checkpointing.save(self._sharded(), str(directory),
                                       async_sharded_save=async_save)

    def _load_tensors(self, directory: Path) -> None:
        loaded = dist_checkpointing.load(self._sharded(loading=True), str(directory))
        self.module.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])

    def _refresh_master_params(self) -> None:
        self.optimizer.reload_model_params()


class _MegatronMPU:
    """The process-group answers DeepSpeed asks its ``mpu`` for, from megatron's parallel state."""

    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """megatron's rule: no weight decay on biases and 1-D parameters (norms, history rows)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0}]


def init_deepspeed_distributed() -> None:
    """DeepSpeed's comm layer over the already-initialised torch process group."""
    import deepspeed

    platform.install_deepspeed_cpu_compat()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def deepspeed_config(cfg: TrainConfig, dp_size: int) -> dict:
    par = cfg.parallel
    gas = par.global_batch_size // (par.micro_batch_size * dp_size)
    zero: dict = {"stage": par.zero_stage}
    if par.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": par.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.optimizer.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": par.precision == "bf16"},
        "fp16": {"enabled": par.precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    resume_needs_same_layout = True

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module,
                 objective: Optional[Objective] = None):
        import deepspeed

        super().__init__(cfg, model, objective)
        opt = cfg.optimizer
        dp = parallel_state.get_data_parallel_world_size()
        torch_optimizer = torch.optim.AdamW(
            param_groups(model, opt.weight_decay), lr=opt.lr, betas=(opt.beta1, opt.beta2),
            eps=opt.eps)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch_optimizer, config=deepspeed_config(cfg, dp),
            mpu=_MegatronMPU(), dist_init_required=False)
        self.scheduler = build_scheduler(cfg, self.optimizer)

    def gradients(self) -> dict[str, torch.Tensor]:
        """ZeRO keeps each rank's share of the reduced gradients: DeepSpeed's own accessor
        gathers every parameter's full gradient (a collective: every rank calls it)."""
        from deepspeed.utils import safe_get_full_grad

        from megatron_iiet.model.sharding import grads_of

        return grads_of(self.module, read=safe_get_full_grad)

    def _loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        loss, metrics = self.objective.loss(batch, self.objective.forward(self.model, batch))
        return loss, {k: float(v) for k, v in metrics.items()}

    def train_step(self, micro_batches: list[dict],
                   before_optimizer_step: Callable[[], None] = lambda: None) -> StepResult:
        metrics = []
        self.objective.prepare(micro_batches, training=True)
        for batch in micro_batches:
            loss, values = self._loss(batch)
            metrics.append(values)
            if not all(math.isfinite(m["loss"]) for m in metrics):
                loss = loss * 0.0  # keep DeepSpeed's accumulation bookkeeping; update skipped below
            self.model.backward(loss)
            if len(metrics) < len(micro_batches):
                self.model.step()
        mean, terms = self._means(metrics)
        if not math.isfinite(mean):
            # boundary without an optimizer step: drop the accumulated (zeroed) gradients
            self.model.zero_grad()
            self.model.micro_steps += 1
            return StepResult(mean, None, True, current_lr(self.optimizer), terms)
        before_optimizer_step()  # ZeRO reduced the gradients in the boundary's backward
        lr = _advance_schedule(self.scheduler, self.optimizer)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return StepResult(mean, None if norm is None else float(norm), False, lr, terms)

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> float:
        self.objective.prepare(micro_batches, training=False)
        return self._means([self._loss(b)[1] for b in micro_batches])[0]

    # ---- state -------------------------------------------------------------------------------
    def _save_tensors(self, directory: Path, async_save: bool):
        # weights in the common format (any engine can take them), then ZeRO's own state
        with self.full_parameters():
            request = dist_checkpointing.save({"model": self.module.sharded_state_dict()},
                                              str(directory), async_sharded_save=async_save)
        self.model.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)
        return request

    def _load_tensors(self, directory: Path) -> None:
        from megatron_iiet.safe_pickle import check_deepspeed_checkpoint

        # module and ZeRO-partitioned optimizer state, in DeepSpeed's own format, which DeepSpeed
        # unpickles without weights_only: checked here first
        check_deepspeed_checkpoint(directory / "deepspeed")
        self.model.load_checkpoint(str(directory / "deepspeed"), tag="state",
                                   load_module_strict=True, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)

    def _refresh_master_params(self) -> None:
        if hasattr(self.model.optimizer, "refresh_fp32_params"):
            self.model.optimizer.refresh_fp32_params()

    def full_parameters(self, modify: bool = False):
        """ZeRO-3 partitions parameters over DP: gather them (and, when ``modify``, scatter
        rank 0's changes back on exit) for checkpoint I/O."""
        if self.model.zero_optimization_stage() != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()),
                                                 modifier_rank=0 if modify else None)


ENGINES: dict[str, type[Engine]] = {e.name: e for e in (MegatronEngine, DeepSpeedEngine)}


def build_engine(cfg: TrainConfig, model: torch.nn.Module,
                 objective: Optional[Objective] = None) -> Engine:
    return ENGINES[cfg.parallel.engine](cfg, model, objective)
