"""Functions run inside spawned gloo ranks by the distributed tests (module level: spawn imports
them by name)."""

from __future__ import annotations

import torch

# (architecture, formulation, iterations) for every variant the acceptance tests cover.
VARIANTS = [
    ("vanilla", "history", None),
    ("ode_rk2", "history", None),
    ("ode_rk2_gated", "history", None),
    ("ode_rk4", "history", None),
    ("pcformer_rk2", "history", None),
    ("pcformer_rk4", "history", None),
    ("iiet", "history", None),
    ("iiet", "history", [3, 1, 0, 2]),
    ("iiet", "fixed_point", None),
]


def variant_id(variant) -> str:
    arch, form, its = variant
    name = arch if arch != "iiet" else f"iiet-{form}"
    return name + ("-" + "".join(map(str, its)) if its else "")


def micro_batches(n: int = 2, batch: int = 2, seq: int = 32, vocab: int = 512, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(batch, seq)})
    return out


def build_tiny(variant, **overrides):
    from megatron.core import parallel_state as ps

    from megatron_iiet.model.config import preset
    from megatron_iiet.model.gpt import IIETModel
    from megatron_iiet.model.sharding import init_layout_independent

    arch, form, its = variant
    cfg = preset(
        "tiny", architecture=arch, formulation=form, iterations=its,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        **overrides,
    )
    model = IIETModel(cfg)
    init_layout_independent(model, seed=1234)
    return model


def loss_and_grads(variants, **overrides):
    """Per variant: the step's micro-batch losses (last stage only) and full gradients."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.pipeline import forward_backward
    from megatron_iiet.model.sharding import gather_full, grads_of

    results = {}
    for variant in variants:
        seed_everything(99)
        model = build_tiny(variant, **overrides)
        seed_everything(5)
        losses = forward_backward(model, micro_batches())
        results[variant_id(variant)] = {
            "losses": losses if ps.is_pipeline_last_stage() else None,
            "grads": gather_full(model, grads_of(model)),
        }
    return results
