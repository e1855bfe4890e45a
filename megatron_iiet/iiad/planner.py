"""IIAD step 2 (spec 6.2): from iteration influences to an E-IIET iteration plan.

Rule: each layer keeps the smallest number of iterations such that every dropped iteration has
influence below the threshold tau, i.e. layer l keeps ``max{i : I[l][i] >= tau}`` iterations
(0 when none reaches tau: the predictor alone). A larger tau never keeps more, so a target pass
count or a target speed-up is met by the smallest tau that reaches it (the plan closest to the
full model that is fast enough).

Predicted savings, per generated token, against the full plan:
* FLOPs: the forward FLOPs per token of model/flops.py (every pass, embedding and LM head
  included) at the given context length;
* decode time: one-token decoding reads each layer's weights once per pass and the LM head once
  (memory-bound), so its cost is modelled as ``passes x layer weights + LM head weights``. It is
  a model, not a measurement: bench/bench_decode.py measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Plan:
    tau: float
    iterations: list[int]
    passes: int
    full_passes: int
    flops_saving: float  # 1 - plan FLOPs / full FLOPs, per token
    decode_saving: float  # 1 - plan decode cost / full, the weight-reading model above

    @property
    def speedup(self) -> float:
        return 1.0 / (1.0 - self.decode_saving)


class PlanError(ValueError):
    """A target no plan reaches (an operator's error: exit 2)."""


def iterations_for(influence: list[list[float]], tau: float) -> list[int]:
    return [max((i for i, value in enumerate(row, start=1) if value >= tau), default=0)
            for row in influence]


def _candidates(influence: list[list[float]]) -> list[float]:
    """Every tau that gives a distinct plan, ascending: -inf keeps all; just above each value
    drops the iterations at that value."""
    values = sorted({v for row in influence for v in row})
    return [-math.inf] + [float(np.nextafter(v, math.inf)) for v in values]


class Planner:
    def __init__(self, influence: list[list[float]], model_config, context_length: int):
        self.influence = influence
        self.config = model_config
        self.context = context_length
        self.full = [len(row) for row in influence]

    def _costs(self, iterations: list[int]) -> tuple[float, float]:
        import dataclasses

        from megatron_iiet.model.flops import passes_per_layer, step_flops

        cfg = dataclasses.replace(self.config, iterations=list(iterations))
        flops = step_flops(cfg, 1, self.context).forward / self.context
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        kv = cfg.num_query_groups or cfg.num_attention_heads
        head_dim = cfg.kv_channels or h // cfg.num_attention_heads
        layer_weights = h * (h + 2 * kv * head_dim) + h * h + 3 * h * f
        decode = sum(passes_per_layer(cfg)) * layer_weights + cfg.vocab_size * h
        return flops, decode

    def plan(self, tau: float) -> Plan:
        iterations = iterations_for(self.influence, tau)
        if sum(self.full) and not any(iterations):
            raise PlanError(f"threshold {tau:.6g} drops every iteration (the largest influence is "
                            f"{max(v for row in self.influence for v in row):.6g}): no IIET is "
                            "left to distil; choose a lower threshold")
        full_flops, full_decode = self._costs(self.full)
        flops, decode = self._costs(iterations)
        return Plan(tau=tau, iterations=iterations, passes=sum(r + 1 for r in iterations),
                    full_passes=sum(r + 1 for r in self.full),
                    flops_saving=1.0 - flops / full_flops, decode_saving=1.0 - decode / full_decode)

    def _first(self, reaches, unreachable: str) -> Plan:
        """The plan of the smallest tau that `reaches` the target (that keeps an iteration)."""
        for tau in _candidates(self.influence)[:-1]:  # the last one drops everything
            plan = self.plan(tau)
            if reaches(plan):
                return plan
        raise PlanError(unreachable)

    def for_passes(self, target: int) -> Plan:
        fewest = len(self.full) + 1
        return self._first(lambda plan: plan.passes <= target,
                           f"--target-passes {target}: a plan that keeps any iteration has at "
                           f"least {fewest} passes")

    def for_speedup(self, target: float) -> Plan:
        # the fastest plan that keeps an iteration: the last candidate before everything drops
        candidates = _candidates(self.influence)
        best = self.plan(candidates[-2]).speedup if len(candidates) > 1 else 1.0
        best = math.floor(best * 1000) / 1000  # printed rounded down, so it is reachable as shown
        return self._first(lambda plan: plan.speedup >= target,
                           f"--target-speedup {target}: not reached by any plan that keeps an "
                           f"iteration; the best reachable is {best:.3f}x (predicted: the LM head "
                           "and the first pass of every layer stay)")


def table(plan: Plan, influence: list[list[float]]) -> str:
    """Markdown: per layer the influences, what is kept and dropped."""
    lines = [f"tau = {plan.tau:.6g}: {plan.passes} of {plan.full_passes} passes, predicted "
             f"FLOP saving {plan.flops_saving:.1%}, decode-time saving {plan.decode_saving:.1%} "
             f"({plan.speedup:.2f}x)", "",
             "| layer | influence of iterations 1..r | kept | dropped |", "|---|---|---|---|"]
    for layer, (row, kept) in enumerate(zip(influence, plan.iterations), start=1):
        values = ", ".join(f"{v:.4g}" for v in row)
        lines.append(f"| {layer} | {values} | {kept} | {len(row) - kept} |")
    return "\n".join(lines)
