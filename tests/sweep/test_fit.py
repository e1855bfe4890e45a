"""Scaling-law fitting (megatron_iiet.sweep.fit) on synthetic losses from a known law: approach 3
recovers the exponents within 0.05 and its bootstrap intervals cover them; one 30% outlier barely
moves alpha (the Huber loss); the closed-form frontier is the numerical optimum; a sweep with an
under-sampled architecture reports it instead of raising, and writes its report and PNGs."""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from megatron_iiet.sweep.fit import (ArchitectureFit, LawFit, SweepFit, bootstrap_intervals,
                                     fit_law, fit_sweep, frontier, optimum_outside_runs,
                                     plot_loss_vs_flops, plot_loss_vs_tokens, plot_residuals,
                                     report_markdown)

TRUE_LAW = LawFit(E=1.7, A=400.0, alpha=0.34, B=410.0, beta=0.28, objective=0.0)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_ladder(law=TRUE_LAW, *, seed=0, noise=0.01, n_sizes=5, n_budgets=5):
    """A full N x D grid (1e5..1e8 parameters, 1e6..1e10 tokens) with multiplicative noise."""
    N, D = (a.ravel() for a in np.meshgrid(np.geomspace(1e5, 1e8, n_sizes), np.geomspace(1e6, 1e10, n_budgets)))
    L = law.predict(N, D) * np.exp(np.random.default_rng(seed).normal(0.0, noise, N.size))
    return N, D, L


@pytest.fixture(scope="module")
def ladder_and_fit():
    N, D, L = synthetic_ladder()
    return (N, D, L), fit_law(N, D, L)


def test_fit_recovers_the_known_exponents(ladder_and_fit):
    _, fit = ladder_and_fit
    assert abs(fit.alpha - TRUE_LAW.alpha) < 0.05
    assert abs(fit.beta - TRUE_LAW.beta) < 0.05
    assert abs(fit.E - TRUE_LAW.E) < 0.2
    assert fit.objective > 0


def test_bootstrap_intervals_cover_the_true_exponents(ladder_and_fit):
    (N, D, L), fit = ladder_and_fit
    intervals = bootstrap_intervals(N, D, L, n_boot=60, level=0.9, seed=1, start=fit)
    assert set(intervals) == {"E", "A", "alpha", "B", "beta"}
    for name in ("alpha", "beta"):
        lo, hi = intervals[name]
        assert lo <= getattr(TRUE_LAW, name) <= hi, (name, lo, hi)
        assert lo <= getattr(fit, name) <= hi
        assert hi - lo < 0.2  # 25 runs over three decades of N do pin the exponents
    for name in ("E", "A", "B"):
        assert 0 < intervals[name][0] <= intervals[name][1]


def test_one_outlier_barely_moves_alpha(ladder_and_fit):
    (N, D, L), clean = ladder_and_fit
    spoiled = L.copy()
    spoiled[7] *= 1.3  # one diverged or mislogged run
    assert abs(fit_law(N, D, spoiled).alpha - clean.alpha) < 0.05


def test_closed_form_frontier_is_the_numerical_optimum():
    k = 6.0 * 2.5  # an IIET-like run that passes each layer ~2.5 times
    for C, n_opt, d_opt, loss in frontier(TRUE_LAW, k, [1e15, 1e18, 1e21]):
        assert math.isclose(k * n_opt * d_opt, C, rel_tol=1e-9)
        numeric = minimize_scalar(lambda log_n: TRUE_LAW.predict(math.exp(log_n), C / (k * math.exp(log_n))),
                                  bounds=(0.0, math.log(C / k)), method="bounded",
                                  options={"xatol": 1e-10})
        assert math.isclose(math.exp(numeric.x), n_opt, rel_tol=1e-3)
        assert math.isclose(numeric.fun, loss, rel_tol=1e-3)
        assert loss == pytest.approx(float(TRUE_LAW.predict(n_opt, d_opt)))


def sweep_rows():
    """vanilla (k=6) and iiet (k=15, a slightly better law) on a 4x4 ladder; pcformer with 3 runs."""
    rows = []
    laws = {"vanilla": (TRUE_LAW, 6.0),
            "iiet": (LawFit(E=1.65, A=380.0, alpha=0.35, B=400.0, beta=0.29, objective=0.0), 15.0)}
    for seed, (name, (law, k)) in enumerate(laws.items()):
        N, D, L = synthetic_ladder(law, seed=seed, n_sizes=4, n_budgets=4)
        for n, d, loss in zip(N, D, L):
            curve = [(t, float(law.predict(n, t))) for t in np.geomspace(d / 100, d, 8)]
            rows.append({"architecture": name, "params": n, "tokens": d, "flops": k * n * d, "loss": loss,
                         "seed": 0, "lr": 1e-3, "size": f"{n:.0e}", "loss_curve": curve})
    for n, d in ((1e5, 1e8), (1e6, 1e8), (1e7, 1e9)):
        rows.append({"architecture": "pcformer", "params": n, "tokens": d, "flops": 9 * n * d,
                     "loss": float(TRUE_LAW.predict(n, d))})
    return rows


def test_sweep_fit_report_and_plots(tmp_path):
    rows = sweep_rows()
    result = fit_sweep(rows, n_boot=10, seed=0)
    assert [a.architecture for a in result.fitted()] == ["iiet", "vanilla"]
    small = result.architectures["pcformer"]
    assert small.fit is None and "not enough runs to fit" in small.reason
    vanilla = result.architectures["vanilla"]
    assert vanilla.k == pytest.approx(6.0) and result.architectures["iiet"].k == pytest.approx(15.0)
    assert len(vanilla.residuals) == vanilla.n_runs == 16 and vanilla.rms_residual < 0.05
    assert vanilla.empirical_frontier and set(vanilla.intervals) == {"E", "A", "alpha", "B", "beta"}

    report = report_markdown(rows, result)
    table_rows = [line for line in report.splitlines() if line.startswith("| iiet |") or line.startswith("| vanilla |")]
    assert len(table_rows) == 2
    assert "pcformer" in report and "not enough runs to fit" in report
    assert "Fitted compute frontier" in report
    assert "too small to pin the exponent" not in report  # 16 runs over 3 decades do pin them

    paths = [tmp_path / name for name in ("loss_vs_flops.png", "loss_vs_tokens.png", "residuals.png")]
    plot_loss_vs_flops(rows, result, paths[0])
    plot_loss_vs_tokens(rows, paths[1])
    plot_residuals(rows, result, paths[2])
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1024, path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temporaries left


def test_wide_exponent_interval_is_called_out():
    """Two sizes, 5% noise: alpha is barely identified, and the report must say so."""
    N, D, L = synthetic_ladder(noise=0.05, n_sizes=2, n_budgets=3)
    rows = [{"architecture": "tiny", "params": n, "tokens": d, "flops": 6 * n * d, "loss": loss}
            for n, d, loss in zip(N, D, L)]
    result = fit_sweep(rows, n_boot=10, seed=0)
    lo, hi = result.architectures["tiny"].intervals["alpha"]
    assert hi - lo > 0.5
    assert "interval of alpha" in report_markdown(rows, result).split("too small to pin the exponent")[0]


def test_a_run_without_loss_is_a_one_line_error():
    rows = [{"architecture": "vanilla", "params": 1e6, "tokens": 1e8, "flops": 6e14}]
    with pytest.raises(ValueError, match="run 0: lacks loss"):
        fit_sweep(rows, n_boot=0)


def test_a_frontier_optimum_outside_the_runs_is_marked_and_never_lowest():
    """The law's optimum at a budget far beyond the ladder needs an N no run had: the report
    marks that loss and does not name a winner from it (a flat-in-N law does this at any C)."""
    N, D, L = synthetic_ladder(noise=0.0)  # N 1e5..1e8, D 1e6..1e10
    rows = [{"architecture": "a", "params": n, "tokens": d, "flops": 6 * n * d, "loss": loss}
            for n, d, loss in zip(N, D, L)]
    result = ArchitectureFit("a", len(rows), TRUE_LAW, {}, 6.0, (), ())
    inside = next(C for C in np.geomspace(1e12, 1e20, 33)
                  if 1e5 <= frontier(TRUE_LAW, 6.0, [C])[0].params <= 1e8
                  and 1e6 <= frontier(TRUE_LAW, 6.0, [C])[0].tokens <= 1e10)
    beyond = 1e30
    assert not optimum_outside_runs(result, rows, inside)
    assert optimum_outside_runs(result, rows, beyond)
    report = report_markdown(rows, SweepFit({"a": result}, 0.9), budgets=[inside, beyond])
    line_in = next(line for line in report.splitlines() if line.startswith(f"| {inside:.3g} |"))
    line_out = next(line for line in report.splitlines() if line.startswith(f"| {beyond:.3g}* |"))
    assert "†" not in line_in and line_in.endswith("| a |")
    assert "†" in line_out and line_out.endswith("| n/a |")
