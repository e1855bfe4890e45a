"""FLOPs of a training step, counting every pass of every layer (for MFU).

Only matrix multiplications are counted (as Megatron-LM and PaLM's MFU do); elementwise work,
norms and the history's weighted sums are a rounding error next to them. Attention scores are
counted for the full s x s product, which is what the unfused kernels compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_iiet.model.architectures import get_architecture
from megatron_iiet.model.config import IIETTransformerConfig
from megatron_iiet.model.ode_step import KEEP_TAIL_MODE, checkpointed_passes


@dataclass(frozen=True)
class StepFlops:
    forward: float  # one forward over the batch
    model: float  # forward + backward (3x forward): what MFU divides by
    hardware: float  # model + recomputed forwards (activation checkpointing)


def block_pass_flops(config: IIETTransformerConfig, tokens: int, seq_length: int) -> float:
    """Forward FLOPs of one pass of one layer's block over ``tokens`` tokens."""
    d = config.hidden_size
    kv = (config.num_query_groups or config.num_attention_heads) * config.kv_channels
    q = config.num_attention_heads * config.kv_channels
    qkv = 2 * tokens * d * (q + 2 * kv)
    scores_and_values = 2 * 2 * tokens * seq_length * q
    out_proj = 2 * tokens * q * d
    fc1_width = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    mlp = 2 * tokens * d * fc1_width + 2 * tokens * config.ffn_hidden_size * d
    return float(qkv + scores_and_values + out_proj + mlp)


def passes_per_layer(config: IIETTransformerConfig) -> list[int]:
    arch = get_architecture(config.architecture, config.formulation)
    return [arch.passes(r) for r in config.layer_iterations]


def step_flops(config: IIETTransformerConfig, batch_size: int, seq_length: int) -> StepFlops:
    """FLOPs of one optimizer step's forward/backward over ``batch_size`` sequences."""
    tokens = batch_size * seq_length
    per_pass = block_pass_flops(config, tokens, seq_length)
    arch = get_architecture(config.architecture, config.formulation)
    passes = passes_per_layer(config)
    # once per layer, not per pass (e.g. RK2-gated's gate)
    added = tokens * sum(part.flops_per_token(config) for part in arch.layer_parameters)
    layers = sum(p * per_pass + added for p in passes)
    logits = 2.0 * tokens * config.hidden_size * config.vocab_size
    forward = layers + logits

    recompute = per_pass
    if config.iteration_checkpointing == KEEP_TAIL_MODE and not config.hidden_dropout:
        recompute -= 2.0 * tokens * config.ffn_hidden_size * config.hidden_size  # FC2 is kept
    recomputed = 0.0
    per_stage = len(passes) // config.pipeline_model_parallel_size
    for start in range(0, len(passes), per_stage):
        stage = passes[start:start + per_stage]
        whole = 0
        if config.recompute_granularity == "full":
            # megatron semantics: 'uniform' recomputes every layer, 'block' the first N per stage
            whole = len(stage) if config.recompute_method == "uniform" else min(
                config.recompute_num_layers, len(stage))
        recomputed += sum(p * per_pass + added for p in stage[:whole])
        for p in stage[whole:]:
            recomputed += sum(checkpointed_passes(config.iteration_checkpointing, p)) * recompute
    return StepFlops(forward=forward, model=3.0 * forward, hardware=3.0 * forward + recomputed)


def mfu(config: IIETTransformerConfig, batch_size: int, seq_length: int,
        step_seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation of a step that took ``step_seconds``."""
    return step_flops(config, batch_size, seq_length).model / step_seconds / peak_flops_per_s
