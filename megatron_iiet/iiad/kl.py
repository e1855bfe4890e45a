"""The distillation term of IIAD (spec 6.3-6.4) on vocab-parallel logits.

``KL(p_teacher || q_student)`` per token, with both distributions at temperature T, computed on
the tensor-parallel vocabulary shards the output layer produces: the log-normalisers need only
the shards' maxima and exp-sums (two all-reduces of one number per token each), and the KL
itself is a sum over the shard followed by one all-reduce. The full vocabulary is never
gathered, so the memory per rank stays ``tokens x vocab / TP``. The gradient with respect to the
student's logits is ``(q - p) / T`` per token; the teacher gets none.

Scaling: ``loss = T^2 x mean KL`` (Hinton et al.: the soft targets' gradients shrink as 1/T^2,
so the T^2 keeps the distillation term's weight independent of the temperature); at T = 1, the
release's setting, it is the plain KL.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def _log_softmax_sharded(logits: torch.Tensor, group) -> torch.Tensor:
    """log softmax over the whole vocabulary, of this rank's shard."""
    peak = logits.max(dim=-1, keepdim=True).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak
    total = shifted.exp().sum(dim=-1, keepdim=True)
    if group is not None:
        dist.all_reduce(total, group=group)
    return shifted - total.log()


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class _VocabParallelKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, temperature: float):
        group = _tp_group()
        log_q = _log_softmax_sharded(_at_least_fp32(student) / temperature, group)
        log_p = _log_softmax_sharded(_at_least_fp32(teacher).to(log_q.dtype) / temperature, group)
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(dim=-1)
        if group is not None:
            dist.all_reduce(kl, group=group)
        ctx.save_for_backward(log_q, p)
        ctx.temperature, ctx.dtype = temperature, student.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        log_q, p = ctx.saved_tensors
        grad = grad_kl.unsqueeze(-1) * (log_q.exp() - p) / ctx.temperature
        return grad.to(ctx.dtype), None, None


def vocab_parallel_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Per-token ``KL(softmax(teacher/T) || softmax(student/T))`` from vocab shards ``[..., V/TP]``
    (the whole vocabulary at TP=1); differentiable in the student's logits only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher logits {tuple(teacher_logits.shape)} do not match the "
                         f"student's {tuple(student_logits.shape)} (another vocabulary?)")
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: must be > 0")
    return _VocabParallelKL.apply(student_logits, teacher_logits.detach(), float(temperature))


def distillation_loss(student_logits: torch.Tensor,
                      teachers: Sequence[tuple[torch.Tensor, float]],
                      temperature: float = 1.0,
                      loss_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list]:
    """``T^2 x sum_t w_t x mean KL_t`` over the tokens (those with ``loss_mask`` 1; every
    position when None, as the release does) and each teacher's term, unweighted."""
    terms = []
    for logits, _weight in teachers:
        kl = vocab_parallel_kl(student_logits, logits, temperature)
        terms.append(temperature ** 2 * masked_token_mean(kl, loss_mask))
    total = sum(w * term for (_, w), term in zip(teachers, terms))
    return total, terms


# ---- top-k teachers (precomputed logits) ------------------------------------------------------

def vocab_parallel_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits over the whole vocabulary from vocab shards ``[..., V/TP]``:
    (global ids int64, values), ordered by value, on every TP rank."""
    group = _tp_group()
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)  # a shard may hold fewer
    if group is None:
        return ids, values
    from megatron.core import parallel_state as ps

    ids = ids + ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    size = ps.get_tensor_model_parallel_world_size()
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_ids = [torch.empty_like(ids) for _ in range(size)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_ids, ids.contiguous(), group=group)
    values, pick = torch.cat(all_values, dim=-1).topk(k, dim=-1)
    return torch.cat(all_ids, dim=-1).gather(-1, pick), values


class _GatherLastDim(torch.autograd.Function):
    """``logits.gather(-1, index)`` keeping only the index for backward (torch's gather keeps the
    logits too, which megatron's in-place cross entropy then overwrites)."""

    @staticmethod
    def forward(ctx, logits, index):
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return logits.gather(-1, index)

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors
        full = torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device)
        return full.scatter_add_(-1, index, grad).to(ctx.dtype), None


def gather_vocab_parallel(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits[..., ids]`` for global vocabulary ids from vocab shards (each rank contributes
    the ids in its range; one all-reduce of ``k`` numbers per token); differentiable."""
    group = _tp_group()
    if group is None:
        return _GatherLastDim.apply(logits, ids)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    per_rank = logits.shape[-1]
    local = ids - ps.get_tensor_model_parallel_rank() * per_rank
    inside = (local >= 0) & (local < per_rank)
    picked = _GatherLastDim.apply(logits, local.clamp(0, per_rank - 1))
    return reduce_from_tensor_model_parallel_region(torch.where(inside, picked, 0.0))


def topk_kl(student_logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """Per-token KL on the teacher's top-k support: both distributions renormalised over the
    same k ids, ``p = softmax(values / T)`` and ``q = softmax(student[ids] / T)``.

    Renormalising the student too (rather than comparing the truncated teacher with the
    student's full softmax) makes the term an exact KL of two distributions, zero when the
    student ranks the k ids like the teacher; the mass the student puts outside the top-k is
    left to the cross entropy. With k = V it is ``vocab_parallel_kl``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature {temperature}: must be > 0")
    picked = _at_least_fp32(gather_vocab_parallel(student_logits, ids.long())) / temperature
    log_q = picked - picked.logsumexp(dim=-1, keepdim=True)
    log_p = torch.log_softmax(_at_least_fp32(values.detach()).to(log_q.dtype) / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def masked_token_mean(per_token: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean over the tokens with ``loss_mask`` 1, or over every position when None."""
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.to(per_token.dtype).reshape(per_token.shape)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
