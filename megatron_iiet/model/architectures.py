"""The architectures of the spec, each declared once: its step, its passes, its parameters.

A step maps one layer's input ``x`` to the layer output; architectures with the cross-layer
history also get the layer's view of it (``history.pop``, ``history.finish``). It calls
``run(u)`` (one pass of the layer's block) as often as it declares in ``passes``; ``run`` owns
checkpointing and pass bookkeeping.

What an architecture adds to the shared block (the history rows, the RK2 gate, PCformer's
model-wide alpha and stage norms) is declared with it as ``Parameters``: the module stack.py
builds (through a megatron ModuleSpec), the names of its tensors in the megatron and HF layouts
(moved by hf/mapping.py) and its matmul FLOPs (counted by flops.py). Nothing else branches on
architecture names, so a new architecture is one ``register_architecture`` call, plus its twin
in the self-contained HF code (an ``ARCHITECTURES`` entry in hf/modeling_iiet.py, whose steps
are written in this same dialect; tests/model/test_registry.py checks that the two sides agree).

Plain torch, no megatron import: the command-line tools read their choice lists here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from megatron_iiet.model.history import LayerHistory, LayerHistoryParams

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_iiet.model.config import IIETTransformerConfig
    from megatron_iiet.model.ode_step import PassRunner

@dataclass(frozen=True)
class StepInputs:
    x: torch.Tensor
    history: Optional[LayerHistory]  # the layer's view of the history (uses_history only)
    run: PassRunner
    layer: nn.Module  # the ODELayer: its block and its architecture's layer parameters by name
    shared: Optional[nn.Module]  # the architecture's model-wide parameters (decoder.shared)
    iterations: int


@dataclass(frozen=True)
class TensorName:
    """One tensor in both layouts. ``{i}`` stands for the 0-based layer in either name."""

    megatron: str  # full name in a TP=1/PP=1 model
    hf: str  # name in the HF state dict
    history_row: bool = False  # the megatron vector of layer i is row i+1 of the HF matrix

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.megatron

    def pairs(self, num_layers: int) -> list[tuple[str, str]]:
        """(megatron, HF) names of the tensors this stands for in a model of `num_layers`
        layers (a history row's HF name is that of its whole matrix)."""
        layers = range(num_layers) if self.per_layer else [None]
        return [(self.megatron.format(i=i), self.hf.format(i=i)) for i in layers]


def _no_flops(config: IIETTransformerConfig) -> float:
    return 0.0


@dataclass(frozen=True)
class Parameters:
    """Parameters an architecture adds to the block: ``module(config=..., **params)`` (plus
    ``layer_number=`` for per-layer ones), built as the ``name`` attribute of every ODELayer or,
    model-wide, as ``decoder.shared``."""

    name: str
    module: type
    tensors: tuple[TensorName, ...]
    params: dict = field(default_factory=dict)
    flops_per_token: Callable[[IIETTransformerConfig], float] = _no_flops  # per layer, forward

    def spec(self) -> ModuleSpec:
        from megatron.core.transformer.spec_utils import ModuleSpec

        return ModuleSpec(module=self.module, params=dict(self.params))


@dataclass(frozen=True)
class Architecture:
    """One registry entry: everything the stack, the config checks, FLOPs and conversion need."""

    name: str
    step: Callable[[StepInputs], torch.Tensor]
    passes: Callable[[int], int]  # iterations of the layer -> passes of its block
    formulation: Optional[str] = None  # one of several forms of the same architecture (IIET)
    iterates: bool = False  # each layer takes `iterations` (E-IIET plans); else they are 0
    uses_history: bool = False  # carries the cross-layer history states (spec section 3)
    layer_parameters: tuple[Parameters, ...] = ()
    shared_parameters: Optional[Parameters] = None  # one copy on every pipeline stage

    @property
    def key(self) -> str:
        return self.name if self.formulation is None else f"{self.name}/{self.formulation}"

    @property
    def tensor_names(self) -> tuple[TensorName, ...]:
        parts = self.layer_parameters + ((self.shared_parameters,) if self.shared_parameters else ())
        return tuple(name for part in parts for name in part.tensors)


# ---- parameters -----------------------------------------------------------------------------
class GateLinear(nn.Linear):
    """RK2-gated's gate: g = sigmoid(W_g [F1; F2]), one scalar per token."""

    def __init__(self, config: IIETTransformerConfig, layer_number: int):
        super().__init__(2 * config.hidden_size, 1, bias=False, dtype=config.params_dtype)
        config.init_method(self.weight)


class PCformerShared(nn.Module):
    """PCformer's model-wide predictor parameters: EMA coefficient a and one norm per stage."""

    def __init__(self, config: IIETTransformerConfig, stages: int):
        super().__init__()
        dtype = config.params_dtype
        self.alpha = nn.Parameter(torch.full((1,), 0.5, dtype=dtype))
        self.stage_norms = nn.ModuleList(
            nn.LayerNorm(config.hidden_size, eps=config.history_norm_eps, dtype=dtype)
            for _ in range(stages)
        )


def _history_tensors() -> tuple[TensorName, ...]:
    ours = "decoder.layers.{i}.history."
    rows = (TensorName(ours + "pop_weight", "model.history.weight", history_row=True),
            TensorName(ours + "refine_weight", "model.history.weight_c", history_row=True))
    norms = tuple(TensorName(f"{ours}{norm}.{p}", f"model.history.{theirs}.{{i}}.{p}")
                  for norm, theirs in (("predictor_norm", "rouge_predictions_norm"),
                                       ("corrector_norm", "layer_norms"))
                  for p in ("weight", "bias"))
    return rows + norms


HISTORY = Parameters("history", LayerHistoryParams, _history_tensors())
RK2_GATE = Parameters(
    "gate", GateLinear,
    (TensorName("decoder.layers.{i}.gate.weight", "model.layers.{i}.gate_linear.weight"),),
    flops_per_token=lambda config: 2.0 * 2 * config.hidden_size,
)


def pcformer_shared(stages: int) -> Parameters:
    norms = tuple(TensorName(f"decoder.shared.stage_norms.{j}.{p}", f"model.RK_norm.{j}.{p}")
                  for j in range(stages) for p in ("weight", "bias"))
    return Parameters("shared", PCformerShared,
                      (TensorName("decoder.shared.alpha", "model.alpha"),) + norms,
                      params={"stages": stages})


# ---- steps ----------------------------------------------------------------------------------
def _vanilla(s: StepInputs):
    return s.run(s.x)


def _rk2(s: StepInputs):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    return s.x + 0.5 * (f1 + f2)


def _rk2_gated(s: StepInputs):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    g = torch.sigmoid(s.layer.gate(torch.cat([f1, f2], dim=-1)))
    return s.x + g * f1 + (1.0 - g) * f2


def _rk4(s: StepInputs):
    x, run = s.x, s.run
    f1 = run.residual(x)
    f2 = run.residual(x + 0.5 * f1)
    f3 = run.residual(x + 0.5 * f2)
    f4 = run.residual(x + f3)
    return x + (f1 + 2.0 * f2 + 2.0 * f3 + f4) / 6.0


def _pcformer_predictor(s: StepInputs) -> torch.Tensor:
    """RK predictor with EMA coefficients (spec 4.1); each o_j normalises the whole block output."""
    x, a, norms = s.x, s.shared.alpha, s.shared.stage_norms
    order = len(norms)
    # Stage inputs: RK2 x, x+o1; RK4 x, x+o1/2, x+o2/2, x+o3.
    input_scale = [1.0] if order == 2 else [0.5, 0.5, 1.0]
    outputs = []
    u = x
    for j in range(order):
        outputs.append(s.run(u, norm=norms[j]))
        if j + 1 < order:
            u = x + input_scale[j] * outputs[j]
    predicted = x
    for j, o in enumerate(outputs):
        # weight of o_j: a (1-a)^(order-1-j)
        predicted = predicted + a * (1.0 - a) ** (order - 1 - j) * o
    return predicted


def _pcformer(s: StepInputs):
    history = s.history
    state = history.predictor_norm(_pcformer_predictor(s))
    state = s.run(history.pop(state), norm=history.corrector_norm)
    return history.finish(state)


def _iiet_history(s: StepInputs):
    history = s.history
    state = s.run(s.x, norm=history.predictor_norm)
    for _ in range(s.iterations):
        state = s.run(history.pop(state), norm=history.corrector_norm)
    return history.finish(state)


def _iiet_fixed_point(s: StepInputs):
    y = s.run(s.x)  # explicit-Euler predictor y_0 = x + F(x)
    for _ in range(s.iterations):
        y = s.x + s.run.residual(y)
    return y


def passes_fixed(n: int) -> Callable[[int], int]:
    """For architectures whose layers run the same number of passes whatever `iterations`."""
    return lambda iterations: n


def _predictor_plus_iterations(iterations: int) -> int:
    return iterations + 1


# ---- the registry ---------------------------------------------------------------------------
BUILT_IN = (
    Architecture("vanilla", _vanilla, passes_fixed(1)),
    Architecture("ode_rk2", _rk2, passes_fixed(2)),
    Architecture("ode_rk2_gated", _rk2_gated, passes_fixed(2), layer_parameters=(RK2_GATE,)),
    Architecture("ode_rk4", _rk4, passes_fixed(4)),
    Architecture("pcformer_rk2", _pcformer, passes_fixed(3), uses_history=True,
                 layer_parameters=(HISTORY,), shared_parameters=pcformer_shared(2)),
    Architecture("pcformer_rk4", _pcformer, passes_fixed(5), uses_history=True,
                 layer_parameters=(HISTORY,), shared_parameters=pcformer_shared(4)),
    Architecture("iiet", _iiet_history, _predictor_plus_iterations, formulation="history",
                 iterates=True, uses_history=True, layer_parameters=(HISTORY,)),
    Architecture("iiet", _iiet_fixed_point, _predictor_plus_iterations,
                 formulation="fixed_point", iterates=True),
)
REGISTRY: dict[str, Architecture] = {a.key: a for a in BUILT_IN}


def register_architecture(architecture: Architecture) -> Architecture:
    """Add an architecture; config validation, the stack, FLOPs, conversion and the CLIs see it."""
    if architecture.key in REGISTRY:
        raise ValueError(f"architecture: {architecture.key!r} is registered already")
    REGISTRY[architecture.key] = architecture
    return architecture


def architecture_names() -> tuple[str, ...]:
    """Every architecture name (what `architecture` may be), in registration order."""
    return tuple(dict.fromkeys(a.name for a in REGISTRY.values()))


def formulation_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.formulation for a in REGISTRY.values() if a.formulation))


def iterating_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.name for a in REGISTRY.values() if a.iterates))


def get_architecture(name: str, formulation: str = "history") -> Architecture:
    """The registered architecture `name`, in `formulation` when it has several (any known
    formulation is accepted, and ignored, for one that has a single form)."""
    if name in REGISTRY:
        if formulation not in formulation_names():
            raise ValueError(f"formulation: unknown {formulation!r}; choose one of "
                             f"{', '.join(formulation_names())}")
        return REGISTRY[name]
    forms = [a.formulation for a in REGISTRY.values() if a.name == name]
    if not forms:
        raise ValueError(f"architecture: unknown {name!r}; choose one of "
                         f"{', '.join(architecture_names())}")
    if formulation not in forms:
        raise ValueError(f"formulation: {name} has no {formulation!r} form; choose one of "
                         f"{', '.join(forms)}")
    return REGISTRY[f"{name}/{formulation}"]
