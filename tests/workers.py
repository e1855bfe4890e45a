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
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent

    arch, form, its = variant
    cfg = preset(
        "tiny", architecture=arch, formulation=form, iterations=its,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        **overrides,
    )
    model = IIETGPTModel(cfg)
    init_layout_independent(model, seed=1234)
    return model


def loss_and_grads(variants, **overrides):
    """Per variant: the step's micro-batch losses (last stage only) and full gradients."""
    from megatron.core import parallel_state as ps

    results = {}
    for variant in variants:
        losses, grads = _step_losses_and_full_grads(variant, **overrides)
        results[variant_id(variant)] = {
            "losses": losses if ps.is_pipeline_last_stage() else None, "grads": grads}
    return results


def _step_losses_and_full_grads(variant, **overrides):
    """One forward/backward step of the tiny model: micro-batch losses, gathered gradients."""
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.sharding import gather_full, grads_of
    from megatron_iiet.training.step import forward_backward

    seed_everything(99)
    model = build_tiny(variant, **overrides)
    seed_everything(5)
    losses = [m["loss"] for m in forward_backward(model, micro_batches())]
    return losses, gather_full(model, grads_of(model))


def checkpointing_matches(variants, modes):
    """Per (variant, mode): are loss and every gradient bitwise equal to no checkpointing?

    Dropout is on (hidden and attention), so recompute must replay the same masks.
    """
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.training.step import forward_backward
    from megatron_iiet.model.sharding import grads_of

    def run(variant, **overrides):
        seed_everything(99)
        model = build_tiny(variant, hidden_dropout=0.1, attention_dropout=0.1, **overrides)
        seed_everything(5)
        losses = [m["loss"] for m in forward_backward(model, micro_batches())]
        return losses, {k: v.clone() for k, v in grads_of(model).items()}

    out = {}
    for variant in variants:
        ref_losses, ref_grads = run(variant)
        for name, overrides in modes.items():
            losses, grads = run(variant, **overrides)
            mismatched = [k for k in ref_grads if not torch.equal(ref_grads[k], grads[k])]
            out[(variant_id(variant), name)] = {
                "losses_equal": losses == ref_losses,
                "mismatched_grads": mismatched,
                "dropout_active": ref_losses != run_without_dropout(variant),
            }
    return out


def kept_tail_recompute(variants, modes=("none", "all_passes", "all_passes_keep_tail")):
    """Per variant and mode, without dropout: the step's gradients and the aten matmuls (``mm``)
    and LayerNorms run during it, counted at dispatch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.model.sharding import grads_of
    from megatron_iiet.training.step import forward_backward

    counted = ("mm", "native_layer_norm")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = dict.fromkeys(counted, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in self.calls:
                self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for variant in variants:
        for mode in modes:
            seed_everything(99)
            model = build_tiny(variant, iteration_checkpointing=mode)
            with Count() as count:
                forward_backward(model, micro_batches())
            passes = sum(layer.passes for layer in model.decoder.layers)
            out[(variant_id(variant), mode)] = {
                "grads": {k: v.clone() for k, v in grads_of(model).items()},
                "calls": count.calls, "passes": passes,
            }
    return out


def run_without_dropout(variant):
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.training.step import forward_backward

    seed_everything(99)
    model = build_tiny(variant)
    seed_everything(5)
    return [m["loss"] for m in forward_backward(model, micro_batches(), forward_only=True)]


def spec_equivalence(seq: int = 16, batch: int = 2):
    """Hidden states of the model's decoder vs direct implementations of the spec formulas.

    Returns max abs differences: IIET history form with one-hot W/Wc and identity Np/Nc vs
    repeated application of each layer's block; the fixed_point form vs the loop
    ``y_0 = x + F(x); y_i = x + F(y_{i-1})`` written here in plain PyTorch.
    """
    from megatron_iiet.distributed import seed_everything

    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(seq, batch, 64, generator=g)
    out = {}

    def rope_for(model):
        return model.rotary_pos_emb(seq)

    # --- history form reduced to repeated block application
    seed_everything(1)
    model = build_tiny(("iiet", "history", [3, 0, 2, 1]))
    with torch.no_grad():
        for layer in model.decoder.layers:
            h = layer.history
            onehot = torch.zeros_like(h.pop_weight)
            onehot[-1] = 1.0
            h.pop_weight.copy_(onehot)
            h.refine_weight.copy_(onehot)
            h.predictor_norm = torch.nn.Identity()
            h.corrector_norm = torch.nn.Identity()
        rope = rope_for(model)
        model.decoder.final_norm = torch.nn.Identity()
        got = model.decoder(x0, rotary_pos_emb=rope)
        want = x0
        for layer in model.decoder.layers:
            for _ in range(layer.iterations + 1):
                want, _ = layer.block(want, attention_mask=None, rotary_pos_emb=rope)
        out["history_onehot_vs_repeated_block"] = (got - want).abs().max().item()
        out["history_onehot_scale"] = want.abs().max().item()

    # --- fixed-point form vs the direct loop
    seed_everything(1)
    model = build_tiny(("iiet", "fixed_point", [3, 0, 2, 1]))
    with torch.no_grad():
        rope = rope_for(model)
        model.decoder.final_norm = torch.nn.Identity()
        got = model.decoder(x0, rotary_pos_emb=rope)
        x = x0
        for layer in model.decoder.layers:
            def F(u, block=layer.block):
                return block(u, attention_mask=None, rotary_pos_emb=rope)[0] - u
            y = x + F(x)
            for _ in range(layer.iterations):
                y = x + F(y)
            x = y
        out["fixed_point_vs_direct_loop"] = (got - x).abs().max().item()
        out["fixed_point_scale"] = x.abs().max().item()
    return out


def flops_against_counter(variants, batch: int = 2, seq: int = 32):
    """Analytic forward FLOPs vs torch's FlopCounterMode on a real forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_iiet.model.flops import step_flops

    out = {}
    for variant in variants:
        model = build_tiny(variant)
        ids = micro_batches(1, batch, seq)[0]["input_ids"]
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            model(ids)
        out[variant_id(variant)] = (counter.get_total_flops(),
                                    step_flops(model.config, batch, seq).forward)
    return out


def preset_parameter_counts(names):
    """Parameters of each preset's model as built (on the meta device: nothing allocated)."""
    from megatron_iiet.model.config import preset
    from megatron_iiet.model.gpt import IIETGPTModel

    counts = {}
    for name in names:
        for arch in ("vanilla", "iiet"):
            cfg = preset(name, architecture=arch, perform_initialization=False)
            with torch.device("meta"):
                model = IIETGPTModel(cfg)
            counts[(name, arch)] = sum(p.numel() for p in model.parameters())
    return counts


def nonfinite_steps_are_skipped(engine_name: str):
    """A step whose loss is NaN changes nothing; the next finite step updates as usual."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.training.config import TrainConfig
    from megatron_iiet.training.engines import build_engine, init_deepspeed_distributed

    if engine_name == "deepspeed":
        init_deepspeed_distributed()
    cfg = TrainConfig()
    cfg.parallel.engine = engine_name
    cfg.parallel.micro_batch_size, cfg.parallel.global_batch_size = 2, 4
    cfg.schedule.warmup_steps = 2
    model = build_tiny(("iiet", "history", None))
    engine = build_engine(cfg, model)
    batches = micro_batches(n=2, batch=2, seq=16)
    embedding = model.embedding.word_embeddings.weight
    token = int(batches[0]["input_ids"][0, 0])
    with torch.no_grad():
        saved_row = embedding[token].clone()
        embedding[token] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poisoned = engine.train_step(batches)
    unchanged = all(torch.equal(before[n], p) or n == "embedding.word_embeddings.weight"
                    for n, p in model.named_parameters())
    row_untouched = torch.isnan(embedding[token]).all().item()
    with torch.no_grad():
        embedding[token] = saved_row
    healthy = engine.train_step(batches)
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters()
                  if n != "embedding.word_embeddings.weight")
    return {"poisoned_skipped": poisoned.skipped, "unchanged": unchanged and row_untouched,
            "healthy_skipped": healthy.skipped, "healthy_changed": changed,
            "healthy_loss_finite": healthy.loss == healthy.loss}


def zero_optimizer_state_bytes(stages):
    """Optimizer state bytes this rank holds after one DeepSpeed step, per ZeRO stage."""
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.training.config import TrainConfig
    from megatron_iiet.training.engines import (
        build_engine, init_deepspeed_distributed, optimizer_state_bytes)

    init_deepspeed_distributed()
    dp = torch.distributed.get_world_size()
    out = {}
    for stage in stages:
        seed_everything(1)
        cfg = TrainConfig()
        cfg.parallel.engine, cfg.parallel.zero_stage = "deepspeed", stage
        cfg.parallel.micro_batch_size, cfg.parallel.global_batch_size = 2, 4
        engine = build_engine(cfg, build_tiny(("iiet", "history", None)))
        engine.train_step(micro_batches(n=2 // dp, batch=2, seq=16))
        out[stage] = optimizer_state_bytes(engine.optimizer)
    return out


def compiled_against_eager(variants):
    """Per variant: eager and ``compile=True`` losses and gradients (no dropout), and, with
    dropout on, the compiled model with and without per-pass checkpointing (recompute must
    replay the compiled pass's dropout masks)."""
    run = _step_losses_and_full_grads
    out = {}
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1, compile=True)
    for variant in variants:
        eager, compiled = run(variant), run(variant, compile=True)
        plain, ckpt = run(variant, **dropout), run(variant, iteration_checkpointing="all_passes",
                                                   **dropout)
        out[variant_id(variant)] = dict(eager=eager, compiled=compiled,
                                        dropout_plain=plain, dropout_checkpointed=ckpt)
    return out
