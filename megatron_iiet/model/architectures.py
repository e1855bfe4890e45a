"""The architectures of the spec, each a few lines over the shared pass and history machinery.

A step maps one layer's input ``x`` and the history states so far to the layer output and the
updated states. It calls ``run(u)`` (one pass of the layer's block) as often as it declares in
``passes``; ``run`` owns checkpointing and pass bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_iiet.model.ode_step import PassRunner

States = list[torch.Tensor]


@dataclass(frozen=True)
class StepInputs:
    x: torch.Tensor
    states: States
    run: PassRunner
    layer: torch.nn.Module  # the ODELayer: .history (LayerHistoryParams), .gate
    shared: torch.nn.Module  # model-wide parameters (PCformer's alpha and stage norms)
    iterations: int


@dataclass(frozen=True)
class Architecture:
    name: str
    step: Callable[[StepInputs], tuple[torch.Tensor, States]]
    passes: Callable[[int], int]  # iterations of the layer -> passes of its block
    uses_history: bool = False
    gated: bool = False
    pcformer_stages: int = 0


def _vanilla(s: StepInputs):
    return s.run(s.x), s.states


def _rk2(s: StepInputs):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    return s.x + 0.5 * (f1 + f2), s.states


def _rk2_gated(s: StepInputs):
    f1 = s.run.residual(s.x)
    f2 = s.run.residual(s.x + f1)
    g = torch.sigmoid(s.layer.gate(torch.cat([f1, f2], dim=-1)))
    return s.x + g * f1 + (1.0 - g) * f2, s.states


def _rk4(s: StepInputs):
    x, run = s.x, s.run
    f1 = run.residual(x)
    f2 = run.residual(x + 0.5 * f1)
    f3 = run.residual(x + 0.5 * f2)
    f4 = run.residual(x + f3)
    return x + (f1 + 2.0 * f2 + 2.0 * f3 + f4) / 6.0, s.states


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
    history = s.layer.history
    states = s.states + [history.predictor_norm(_pcformer_predictor(s))]
    states[-1] = s.run(history.pop(states), norm=history.corrector_norm)
    return history.refine(states), states


def _iiet_history(s: StepInputs):
    history = s.layer.history
    states = s.states + [s.run(s.x, norm=history.predictor_norm)]
    for _ in range(s.iterations):
        states[-1] = s.run(history.pop(states), norm=history.corrector_norm)
    return history.refine(states), states


def _iiet_fixed_point(s: StepInputs):
    y = s.run(s.x)  # explicit-Euler predictor y_0 = x + F(x)
    for _ in range(s.iterations):
        y = s.x + s.run.residual(y)
    return y, s.states


def _one_pass(iterations: int) -> int:
    return 1


def _passes_fixed(n: int) -> Callable[[int], int]:
    return lambda iterations: n


def _predictor_plus_iterations(iterations: int) -> int:
    return iterations + 1


REGISTRY: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("vanilla", _vanilla, _one_pass),
        Architecture("ode_rk2", _rk2, _passes_fixed(2)),
        Architecture("ode_rk2_gated", _rk2_gated, _passes_fixed(2), gated=True),
        Architecture("ode_rk4", _rk4, _passes_fixed(4)),
        Architecture("pcformer_rk2", _pcformer, _passes_fixed(3), uses_history=True,
                     pcformer_stages=2),
        Architecture("pcformer_rk4", _pcformer, _passes_fixed(5), uses_history=True,
                     pcformer_stages=4),
        Architecture("iiet/history", _iiet_history, _predictor_plus_iterations,
                     uses_history=True),
        Architecture("iiet/fixed_point", _iiet_fixed_point, _predictor_plus_iterations),
    )
}


def get_architecture(name: str, formulation: str = "history") -> Architecture:
    key = f"{name}/{formulation}" if name == "iiet" else name
    if key not in REGISTRY:
        raise ValueError(f"architecture: unknown {name!r}")
    return REGISTRY[key]
