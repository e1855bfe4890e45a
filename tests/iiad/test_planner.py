"""The threshold planner (spec 6.2): the rule, exactly; target passes and target speed-up find
the smallest threshold that reaches them; what no plan reaches is refused."""

import math

import pytest

from megatron_iiet.iiad.planner import Planner, PlanError, iterations_for
from megatron_iiet.model.config import preset

INFLUENCE = [  # 4 layers x 3 iterations; note layer 2's late iteration above an early one
    [0.50, 0.20, 0.01],
    [0.30, 0.001, 0.05],
    [0.002, 0.0, -0.01],
    [0.40, 0.10, 0.03],
]


def planner():
    return Planner(INFLUENCE, preset("tiny", architecture="iiet"), 128)


@pytest.mark.parametrize("tau", [-1.0, 0.0, 0.001, 0.0011, 0.02, 0.05, 0.3, 0.45])
def test_every_dropped_iteration_is_below_tau_and_the_plan_is_minimal(tau):
    plan = iterations_for(INFLUENCE, tau)
    for row, kept in zip(INFLUENCE, plan):
        assert all(v < tau for v in row[kept:]), (tau, row, kept)  # dropped: below tau
        assert kept == 0 or row[kept - 1] >= tau  # one fewer would drop one at or above tau


def test_plan_reports_passes_and_savings():
    p = planner().plan(0.02)
    assert p.iterations == [2, 3, 0, 3]
    assert p.passes == 3 + 4 + 1 + 4 and p.full_passes == 16
    assert 0 < p.flops_saving < 1 and 0 < p.decode_saving < 1
    assert math.isclose(p.speedup, 1 / (1 - p.decode_saving))
    full = planner().plan(-math.inf)
    assert full.iterations == [3, 3, 3, 3] and full.flops_saving == 0 == full.decode_saving


def test_target_passes_finds_the_smallest_threshold_that_reaches_it():
    pl = planner()
    for target in range(5, 17):
        plan = pl.for_passes(target)
        assert plan.passes <= target
        smaller = [t for t in sorted({v for r in INFLUENCE for v in r}) if t < plan.tau]
        # any lower threshold keeps more passes than the target allows
        assert all(pl.plan(t).passes > target for t in smaller if t < plan.tau and
                   iterations_for(INFLUENCE, t) != plan.iterations)


def test_target_speedup_finds_the_smallest_threshold_that_reaches_it():
    pl = planner()
    plan = pl.for_speedup(1.5)
    assert plan.speedup >= 1.5
    lower = [t for t in sorted({v for r in INFLUENCE for v in r}) if t < plan.tau]
    assert lower and all(pl.plan(t).speedup < 1.5 for t in lower)


def test_unreachable_targets_and_a_threshold_that_drops_everything_are_refused():
    pl = planner()
    with pytest.raises(PlanError, match="at least 5 passes"):
        pl.for_passes(4)
    with pytest.raises(PlanError, match="not reached") as refused:
        pl.for_speedup(100.0)
    # the message names the best reachable speed-up, and that value is reachable
    best = float(str(refused.value).split("best reachable is ")[1].split("x")[0])
    assert pl.for_speedup(best).speedup == pytest.approx(best, abs=1e-3)
    with pytest.raises(PlanError, match="not reached"):
        pl.for_speedup(best + 0.01)
    with pytest.raises(PlanError, match="drops every iteration"):
        pl.plan(0.6)
