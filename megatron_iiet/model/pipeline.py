"""Forward/backward over micro-batches through megatron-core's schedules, history included.

``forward_backward`` is the one training-step primitive the trainer, the tests and the
benchmarks share: it picks megatron's no-pipelining or 1F1B schedule, widens what crosses a
stage boundary to carry the cross-layer history, and sums gradients of parameters that exist on
several stages.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from megatron_iiet.model.sharding import pipeline_shared_params


def _grad_buffer(p: torch.Tensor):
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def allreduce_cross_stage_grads(models, embeddings: bool = True) -> None:
    """Sum gradients of parameters replicated on several pipeline stages.

    The tied word embedding lives on the first and last stage (megatron's embedding group;
    ``embeddings=False`` when megatron's own finalize_model_grads already handled it), and
    PCformer's shared predictor parameters live on every stage.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if embeddings:
        for m in models:
            unwrapped = get_attr_wrapped_model(m, "shared_embedding_or_output_weight",
                                               return_model_obj=True)
            if not (unwrapped.share_embeddings_and_output_weights
                    and (unwrapped.pre_process or unwrapped.post_process)):
                continue
            weight = unwrapped.shared_embedding_or_output_weight()
            grad = _grad_buffer(weight)
            if grad is None:
                grad = weight.grad = torch.zeros_like(weight)
            dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    group = parallel_state.get_pipeline_model_parallel_group()
    for p in pipeline_shared_params(models):
        grad = _grad_buffer(p)
        if grad is None:
            grad = p.grad = torch.zeros_like(p)
        dist.all_reduce(grad, group=group)


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    total = (per_token_loss.reshape(-1).float() * mask).sum()
    tokens = mask.sum().clamp(min=1)
    loss = total / tokens
    # megatron scales the returned loss in place; report an unscaled copy
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator, model):
    batch = next(data_iterator)
    out = model(batch["input_ids"], labels=batch["labels"])
    return out, lambda output: _loss_func(batch["loss_mask"], output)


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[dict],
    forward_only: bool = False,
) -> list[float]:
    """Run all micro-batches of one step; returns each micro-batch's mean loss (last stage).

    Each micro-batch is a dict of ``input_ids``, ``labels`` and ``loss_mask`` ([b, s]); every
    pipeline stage gets the same dicts (stages past the first only read their shapes).
    The returned gradients are those of the mean over micro-batches.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    schedule = get_forward_backward_func()
    b, s = micro_batches[0]["input_ids"].shape
    kwargs = {}
    if pp > 1:
        unwrapped = get_attr_wrapped_model(model, "pipeline_tensor_shapes", return_model_obj=True)
        kwargs["adjust_tensor_shapes_fn"] = unwrapped.pipeline_tensor_shapes
    losses = schedule(
        forward_step_func=_forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
        **kwargs,
    )
    if not forward_only and getattr(model, "config", None) is not None:
        if model.config.finalize_model_grads_func is None:
            allreduce_cross_stage_grads([model])
    return [float(x["lm loss"]) for x in losses]
