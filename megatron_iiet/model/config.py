"""Model configuration: megatron-core's TransformerConfig plus what IIET and its baselines add."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_iiet.model.architectures import get_architecture, iterating_names
from megatron_iiet.model.ode_step import KEEP_TAIL_MODE
from megatron_iiet.platform import gpu_only_refusal, model_config_defaults

ITERATION_CHECKPOINTING = ("none", "all_passes", "all_but_last_pass", KEEP_TAIL_MODE)
HISTORY_INITS = ("uniform", "current")


def _init_normal(std: float):
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


@dataclass
class IIETTransformerConfig(TransformerConfig):
    """A megatron TransformerConfig that also says how each layer's block is iterated.

    The block itself (pre-norm attention + SwiGLU MLP, RMSNorm, no biases) is configured through
    the inherited fields; the defaults below are the spec's LLaMA-style block.
    """

    architecture: str = "iiet"
    """One of architectures.architecture_names() (spec sections 1-5)."""

    formulation: str = "history"
    """IIET only: "history" (the released form, spec 5b) or "fixed_point" (paper form, 5a)."""

    iterations: Optional[list[int]] = None
    """IIET only: fixed-point iterations per layer (E-IIET); None means `max_iterations` for all."""

    max_iterations: int = 3
    """IIET: r, the iterations the model was (or is being) trained with."""

    iteration_checkpointing: str = "none"
    """Per-pass activation checkpointing: none | all_passes | all_but_last_pass |
    all_passes_keep_tail (every pass, but FC2's and the pass norm's inputs are kept, so FC2's
    matmul and the norm are not recomputed, for ffn/h + 1 more hidden-size vectors per token
    per pass)."""

    compile: bool = False
    """Run each pass (block + its norm) under torch.compile, one compiled function shared by all
    layers. Off by default: on CPU it buys 3-6% for IIET and PCformer and nothing for vanilla,
    for a compile of ~10-70 s per rank (docs/benchmarks.md, "torch.compile of the pass").
    Training only: evaluation and the HF export run eagerly."""

    history_norm_eps: float = 1e-5
    """eps of the history LayerNorms (Np, Nc) and PCformer's stage norms."""

    history_init: str = "uniform"
    """Initial rows of the history weights W, Wc (PCformer and IIET's history form): "uniform"
    (the spec and the release: row l averages S_0..S_l) or "current" (one-hot on S_l, so each
    layer starts by reading only its own state; an ablation, not the paper's)."""

    vocab_size: int = 32000
    max_sequence_length: int = 2048
    share_embeddings_and_output_weights: bool = True
    rotary_base: int = 10000

    # The spec's block; overriding megatron's GPT-2-era defaults.
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-6
    gated_linear_unit: bool = True
    activation_func: callable = F.silu
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    apply_rope_fusion: bool = False
    persist_layer_norm: bool = False
    gradient_accumulation_fusion: bool = False
    cross_entropy_loss_fusion: bool = False
    use_cpu_initialization: bool = field(
        default_factory=lambda: model_config_defaults()["use_cpu_initialization"])
    batch_p2p_sync: bool = field(default_factory=lambda: model_config_defaults()["batch_p2p_sync"])

    def __post_init__(self):
        self._validate_iiet_fields()
        if self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
        if self.init_method is None:
            self.init_method = _init_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            # LLaMA-style: every matrix N(0, 0.02), no depth scaling (spec section 7).
            self.output_layer_init_method = _init_normal(self.init_method_std)
        super().__post_init__()
        refusal = self.sequence_parallel and gpu_only_refusal("sequence_parallel")
        if refusal:
            raise ValueError(f"sequence_parallel: {refusal}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def layer_iterations(self) -> list[int]:
        """Iterations of every layer (0 for architectures that do not iterate)."""
        if not get_architecture(self.architecture, self.formulation).iterates:
            return [0] * self.num_layers
        if self.iterations is None:
            return [self.max_iterations] * self.num_layers
        return list(self.iterations)

    # ---- validation ----------------------------------------------------------------------
    def _validate_iiet_fields(self) -> None:
        architecture = get_architecture(self.architecture, self.formulation)  # checks the names
        if self.max_iterations < 0:
            raise ValueError(f"max_iterations: must be >= 0, got {self.max_iterations}")
        if self.iterations is not None:
            if not architecture.iterates:
                raise ValueError(
                    f"iterations: only the {' / '.join(iterating_names())} architecture "
                    f"iterates, not {self.architecture!r}"
                )
            its = list(self.iterations)
            if len(its) != self.num_layers:
                raise ValueError(
                    f"iterations: needs one entry per layer ({self.num_layers}), got {len(its)}"
                )
            bad = [i for i in its if not isinstance(i, int) or i < 0 or i > self.max_iterations]
            if bad:
                raise ValueError(
                    f"iterations: each entry must be an int in 0..max_iterations "
                    f"({self.max_iterations}); got {bad}"
                )
            self.iterations = its
        if self.history_init not in HISTORY_INITS:
            raise ValueError(
                f"history_init: unknown {self.history_init!r}; choose one of "
                f"{', '.join(HISTORY_INITS)}"
            )
        if self.iteration_checkpointing not in ITERATION_CHECKPOINTING:
            raise ValueError(
                f"iteration_checkpointing: unknown {self.iteration_checkpointing!r}; choose one "
                f"of {', '.join(ITERATION_CHECKPOINTING)}"
            )
        pp = self.pipeline_model_parallel_size
        if pp > 1 and self.num_layers % pp != 0:
            raise ValueError(
                f"pipeline_model_parallel_size: {pp} does not divide num_layers ({self.num_layers})"
            )
        if self.iteration_checkpointing == KEEP_TAIL_MODE and self.compile:
            raise ValueError(
                f"iteration_checkpointing: {KEEP_TAIL_MODE!r} cannot be combined with "
                "model.compile (a compiled pass saves its tensors as one graph, so its tail "
                "cannot be kept apart); use 'all_passes' with compile"
            )
        if self.iteration_checkpointing != "none":
            if self.recompute_granularity == "selective":
                raise ValueError(
                    "iteration_checkpointing: cannot be combined with recompute_granularity="
                    "'selective': the selected modules would be recomputed twice (once inside "
                    "each recomputed pass); use one of the two"
                )
            if self.recompute_granularity == "full" and self.recompute_method == "uniform":
                raise ValueError(
                    "iteration_checkpointing: cannot be combined with recompute_granularity='full'"
                    " and recompute_method='uniform', which recomputes every layer: its passes "
                    "would be recomputed twice. Use recompute_method='block' (layers past "
                    "recompute_num_layers then use per-pass checkpointing) or one of the two"
                )

    def replace(self, **changes) -> "IIETTransformerConfig":
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(changes)
        return IIETTransformerConfig(**values)


class Knob(NamedTuple):
    """Where a model-config field goes besides the model."""

    run: bool = False
    """A training run may set it: `model.<name>` in its YAML or `--set` (training/config.py's
    ModelSection has one field per such knob, of the field's type, None meaning the preset's or
    this config's default)."""
    hf: Optional[str] = None
    """Its name in the exported HF config (IIETConfig); None: it never reaches the export
    (training-only: checkpointing, compile, dropout, the history's initialisation)."""
    hf_derived: bool = False
    """The HF config has it, but hf/mapping.py derives it instead of copying the value: the
    formulation through the architecture, the per-layer iterations, the padded vocabulary, the
    positions."""


# Every model-config field that is more than megatron-core plumbing, declared once with where it
# goes; the field's type, default and meaning are IIETTransformerConfig's. A new knob is its
# field above plus one line here. tests/model/test_knobs.py checks that every field this config
# adds to megatron's is listed, and every HF name is an IIETConfig field.
KNOBS: dict[str, Knob] = {
    "architecture": Knob(run=True, hf="architecture"),
    "formulation": Knob(run=True, hf="formulation", hf_derived=True),
    "iterations": Knob(run=True, hf="iterations", hf_derived=True),
    "max_iterations": Knob(run=True, hf="max_iterations"),
    "iteration_checkpointing": Knob(run=True),
    "compile": Knob(run=True),
    "recompute_granularity": Knob(run=True),
    "recompute_method": Knob(run=True),
    "recompute_num_layers": Knob(run=True),
    "num_layers": Knob(run=True, hf="num_hidden_layers"),
    "hidden_size": Knob(run=True, hf="hidden_size"),
    "num_attention_heads": Knob(run=True, hf="num_attention_heads"),
    "num_query_groups": Knob(run=True, hf="num_key_value_heads"),
    "ffn_hidden_size": Knob(run=True, hf="intermediate_size"),
    "share_embeddings_and_output_weights": Knob(run=True, hf="tie_word_embeddings"),
    "hidden_dropout": Knob(run=True),
    "attention_dropout": Knob(run=True),
    "init_method_std": Knob(run=True, hf="initializer_range"),
    "history_init": Knob(run=True),
    "history_norm_eps": Knob(hf="history_norm_eps"),
    "layernorm_epsilon": Knob(hf="rms_norm_eps"),
    "rotary_base": Knob(hf="rope_theta"),
    "vocab_size": Knob(hf="vocab_size", hf_derived=True),
    "max_sequence_length": Knob(hf="max_position_embeddings", hf_derived=True),
}


def knob_type(name: str):
    """The type IIETTransformerConfig (or megatron-core's TransformerConfig) declares for a
    field, resolved from its annotation in the module that declares it."""
    import sys

    for cls in IIETTransformerConfig.__mro__:
        annotation = vars(cls).get("__annotations__", {}).get(name)
        if annotation is not None:
            if isinstance(annotation, str):
                return eval(annotation, vars(sys.modules[cls.__module__]))  # noqa: S307 (our source)
            return annotation
    raise KeyError(f"{name}: not a field of IIETTransformerConfig")


# Spec section 7: name -> (hidden, layers, heads, FFN, tied embeddings)
PRESET_SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=176,
                 share_embeddings_and_output_weights=True, vocab_size=512, max_sequence_length=128),
    "55m": dict(hidden_size=512, num_layers=12, num_attention_heads=4, ffn_hidden_size=1408,
                share_embeddings_and_output_weights=True),
    "340m": dict(hidden_size=1024, num_layers=24, num_attention_heads=8, ffn_hidden_size=2816,
                 share_embeddings_and_output_weights=True),
    "1.3b": dict(hidden_size=2048, num_layers=24, num_attention_heads=16, ffn_hidden_size=5432,
                 share_embeddings_and_output_weights=False),
}


def preset(name: str, **overrides) -> IIETTransformerConfig:
    """A config for one of the spec's model sizes, with any field overridden."""
    if name not in PRESET_SHAPES:
        raise ValueError(f"preset: unknown {name!r}; choose one of {', '.join(PRESET_SHAPES)}")
    known = {f.name for f in dataclasses.fields(IIETTransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of IIETTransformerConfig")
    values = dict(PRESET_SHAPES[name])
    values.update(overrides)
    return IIETTransformerConfig(**values)
