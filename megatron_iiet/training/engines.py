"""Two ways to own the optimizer, one interface for the training loop.

``MegatronEngine``: megatron-core's DistributedDataParallel and optimizer (its distributed
optimizer on GPU), micro-batches through megatron's schedules (1F1B with PP).
``DeepSpeedEngine``: DeepSpeed's ZeRO 1/2/3 (optional CPU offload of optimizer state) around the
same megatron-core TP model, PP=1. DeepSpeed's own activation checkpointing is never enabled:
recompute is ours (per pass / per layer), configured on the model.

Both use the same parameter groups (no weight decay on vectors), the same AdamW arithmetic and
megatron's OptimizerParamScheduler, so they follow the same trajectory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_iiet.model.pipeline import allreduce_cross_stage_grads, forward_backward
from megatron_iiet.training.config import TrainConfig


@dataclass
class StepResult:
    loss: float  # mean over the global batch (every rank gets it)
    grad_norm: Optional[float]
    skipped: bool  # non-finite loss: no update was applied
    lr: float


def _global_mean_loss(losses: list[float]) -> float:
    """Mean micro-batch loss over the data-parallel group, known to every rank."""
    reporting = parallel_state.is_pipeline_last_stage() and losses
    t = torch.tensor([sum(losses) / len(losses) if reporting else 0.0, 1.0 if reporting else 0.0],
                     dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def build_scheduler(cfg: TrainConfig, optimizer) -> OptimizerParamScheduler:
    s, o = cfg.schedule, cfg.optimizer
    return OptimizerParamScheduler(
        optimizer,
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


def _current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _advance_schedule(scheduler, optimizer) -> float:
    """Set the learning rate of the update about to happen: update k (1-based) uses the
    schedule's value at k, so warm-up never spends its first step at lr 0."""
    scheduler.step(increment=1)
    return _current_lr(optimizer)


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


class MegatronEngine:
    name = "megatron"

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        par, opt = cfg.parallel, cfg.optimizer
        self.module = model
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

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = forward_backward(self.model, micro_batches)
        loss = _global_mean_loss(losses)
        if not math.isfinite(loss):
            return StepResult(loss, None, True, _current_lr(self.optimizer))
        lr = _advance_schedule(self.scheduler, self.optimizer)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:  # fp16 overflow: no update, so the schedule does not advance either
            self.scheduler.step(increment=-1)
            return StepResult(loss, None, True, lr)
        return StepResult(loss, grad_norm, False, lr)

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> float:
        return _global_mean_loss(forward_backward(self.model, micro_batches, forward_only=True))

    def full_parameters(self, modify: bool = False):
        """Parameters are always whole on their rank here."""
        return contextlib.nullcontext()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)


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
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm's `torch` attribute is torch itself)

    from megatron_iiet.platform import cuda_available

    if not cuda_available():
        # Its CPU backend JIT-compiles a shared-memory all-reduce (~50 s) used only by inference
        # kernels; training collectives go through torch.distributed (gloo) either way.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
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


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module):
        import deepspeed

        opt = cfg.optimizer
        self.module = model
        dp = parallel_state.get_data_parallel_world_size()
        torch_optimizer = torch.optim.AdamW(
            param_groups(model, opt.weight_decay), lr=opt.lr, betas=(opt.beta1, opt.beta2),
            eps=opt.eps)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch_optimizer, config=deepspeed_config(cfg, dp),
            mpu=_MegatronMPU(), dist_init_required=False)
        self.scheduler = build_scheduler(cfg, self.optimizer)

    def _loss(self, batch: dict) -> torch.Tensor:
        per_token = self.model(batch["input_ids"], labels=batch["labels"])
        mask = batch["loss_mask"].float()
        return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        losses = []
        for batch in micro_batches:
            loss = self._loss(batch)
            losses.append(loss.item())
            if not all(map(math.isfinite, losses)):
                loss = loss * 0.0  # keep DeepSpeed's accumulation bookkeeping; update skipped below
            self.model.backward(loss)
            if len(losses) < len(micro_batches):
                self.model.step()
        mean = _global_mean_loss(losses)
        if not math.isfinite(mean):
            # boundary without an optimizer step: drop the accumulated (zeroed) gradients
            self.model.zero_grad()
            self.model.micro_steps += 1
            return StepResult(mean, None, True, _current_lr(self.optimizer))
        lr = _advance_schedule(self.scheduler, self.optimizer)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return StepResult(mean, None if norm is None else float(norm), False, lr)

    @torch.no_grad()
    def eval_step(self, micro_batches: list[dict]) -> float:
        return _global_mean_loss([self._loss(b).item() for b in micro_batches])

    def full_parameters(self, modify: bool = False):
        """ZeRO-3 partitions parameters over DP: gather them (and, when ``modify``, scatter
        rank 0's changes back on exit) for checkpoint I/O."""
        if self.model.zero_optimization_stage() != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()),
                                                 modifier_rank=0 if modify else None)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)


def build_engine(cfg: TrainConfig, model: torch.nn.Module):
    return (MegatronEngine if cfg.parallel.engine == "megatron" else DeepSpeedEngine)(cfg, model)
