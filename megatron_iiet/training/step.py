"""What one training step computes: the objective (the loss extension point) and the
forward/backward over micro-batches through megatron-core's schedules, history included.

``forward_backward`` is the one training-step primitive the engines, the tests and the
benchmarks share: it picks megatron's no-pipelining or 1F1B schedule, widens what crosses a
stage boundary to carry the cross-layer history, and sums gradients of parameters that exist on
several stages.

``Objective`` is where the loss comes from. The default is the language-model loss (the masked
mean of the per-token cross entropy). Extra terms, e.g. a distillation loss, are added with
``Objective(extra_terms=[...])`` and handed to the engine; the training loop does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from megatron_iiet.model.sharding import grad_of, pipeline_shared_params
from megatron_iiet.platform import compute_device


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
            grad = grad_of(weight)
            if grad is None:
                grad = weight.grad = torch.zeros_like(weight)
            dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    group = parallel_state.get_pipeline_model_parallel_group()
    for p in pipeline_shared_params(models):
        grad = grad_of(p)
        if grad is None:
            grad = p.grad = torch.zeros_like(p)
        dist.all_reduce(grad, group=group)


LossTerm = Callable[[dict, torch.Tensor], torch.Tensor]
"""An extra loss term: (micro-batch, the model's per-token loss [b, s]) -> a scalar to add."""


def masked_mean(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    mask = loss_mask.reshape(-1).float()
    return (per_token.reshape(-1).float() * mask).sum() / mask.sum().clamp(min=1)


@dataclass
class Objective:
    """The loss a step minimises: the language-model loss plus ``extra_terms`` (name -> term).

    Every term is logged under its name in the step's metrics (``lm`` for the LM loss); the
    reported ``loss`` is their sum. It is evaluated on the last pipeline stage, per micro-batch.
    """

    extra_terms: dict[str, LossTerm] = field(default_factory=dict)

    @property
    def metric_names(self) -> list[str]:
        """What ``loss`` reports: the total, and its terms when there are several."""
        return ["loss", "lm", *self.extra_terms] if self.extra_terms else ["loss"]

    def prepare(self, micro_batches: list[dict], training: bool) -> None:
        """Called by the engines before the micro-batches of a step (``training``) or of a
        validation pass run: the place for work over the whole step, e.g. teachers."""

    def forward(self, model, batch: dict) -> torch.Tensor:
        return model(batch["input_ids"], labels=batch["labels"])

    def loss(self, batch: dict, per_token_loss: torch.Tensor):
        lm = masked_mean(per_token_loss, batch["loss_mask"])
        if not self.extra_terms:
            return lm, {"loss": lm.detach().clone()}  # megatron scales the loss in place
        terms = {"lm": lm, **{name: term(batch, per_token_loss)
                              for name, term in self.extra_terms.items()}}
        total = sum(terms.values())
        return total, {"loss": total.detach().clone(),
                       **{name: t.detach().clone() for name, t in terms.items()}}


LANGUAGE_MODEL = Objective()


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[dict],
    forward_only: bool = False,
    objective: Optional[Objective] = None,
) -> list[dict[str, float]]:
    """Run all micro-batches of one step; returns each micro-batch's metrics (``loss`` and each
    term of ``objective``), on the last stage (empty elsewhere).

    Each micro-batch is a dict of ``input_ids``, ``labels`` and ``loss_mask`` ([b, s]); every
    pipeline stage gets the same dicts (stages past the first only read their shapes).
    The returned gradients are those of the mean over micro-batches.
    """
    objective = objective or LANGUAGE_MODEL
    micro_batches = _on_compute_device(micro_batches)
    objective.prepare(micro_batches, training=not forward_only)

    def forward_step(data_iterator: Iterator, model):
        batch = next(data_iterator)
        return objective.forward(model, batch), lambda output: objective.loss(batch, output)

    metrics = _run_schedule(model, micro_batches, forward_step, forward_only)
    if not forward_only and getattr(model, "config", None) is not None:
        if model.config.finalize_model_grads_func is None:
            allreduce_cross_stage_grads([model])
    return [{k: float(v) for k, v in m.items()} for m in metrics]


def _on_compute_device(micro_batches: list[dict]) -> list[dict]:
    """The micro-batches on the model's device, wherever they were made (the training loader,
    evaluation windows read from disk): on a GPU the model cannot read CPU tensors."""
    device = compute_device()
    return [{k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
             for k, v in batch.items()} for batch in micro_batches]


def _run_schedule(model, micro_batches: list[dict], forward_step, forward_only: bool,
                  collect_non_loss_data: bool = False) -> list:
    """megatron's schedule for this layout (no pipelining or 1F1B) over ``micro_batches``;
    what crosses a stage boundary is widened to carry the cross-layer history."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    schedule = get_forward_backward_func()
    b, s = micro_batches[0]["input_ids"].shape
    kwargs = {}
    if pp > 1:
        unwrapped = get_attr_wrapped_model(model, "pipeline_tensor_shapes", return_model_obj=True)
        kwargs["adjust_tensor_shapes_fn"] = unwrapped.pipeline_tensor_shapes
    return schedule(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        **kwargs,
    )


def forward_only(model, micro_batches: list[dict], forward: Callable, reduce: Callable) -> list:
    """The model over ``micro_batches`` without gradients, at any TP/PP layout.

    ``forward(model, batch)`` returns what the model returns (logits on the last stage);
    ``reduce(batch, output)`` runs on the last stage and its results come back, one per
    micro-batch (an empty list on other stages). Evaluation and generation are built on it.
    """
    def forward_step(data_iterator: Iterator, model):
        batch = next(data_iterator)
        return forward(model, batch), lambda output, non_loss_data=True: reduce(batch, output)

    with torch.no_grad():
        return _run_schedule(model, micro_batches, forward_step, forward_only=True,
                             collect_non_loss_data=True)
