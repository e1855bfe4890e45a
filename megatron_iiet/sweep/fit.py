"""Scaling-law fits of a sweep: L(N, D) = E + A/N^alpha + B/D^beta per architecture.

Why: issue 14 asks whether IIET's advantage over vanilla and PCformer grows or shrinks with
scale. A single run per size cannot say; a law fitted per architecture, with bootstrap intervals
that show how much the ladder actually pins down, and the compute frontier L(C) it implies, can.
The fit is Chinchilla's approach 3 (Hoffmann et al. 2022, appendix D.2), done with scipy's
L-BFGS-B rather than a hand-written optimiser. Plots are rendered with matplotlib's Agg canvas
(no pyplot, no display, no global state) and written atomically.

Rows are dicts, one per finished run: `architecture`, `params` (non-embedding N), `tokens` (D),
`flops` (total training FLOPs C, counted by the caller with every pass), `loss` (validation), and
optionally `seed`, `lr`, `size` (a label) and `loss_curve` ([(tokens, loss), ...]).
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.optimize import minimize
from scipy.special import huber

from megatron_iiet.data.atomic import write_bytes_atomic

HUBER_DELTA = 1e-3  # the paper's delta: on log-loss residuals of ~1e-2 this is nearly an L1 fit
MIN_RUNS, MIN_DISTINCT = 5, 2  # five numbers cannot be fitted from fewer runs, nor a slope from one N
WIDE_EXPONENT_INTERVAL = 0.5
LAW_PARAMETERS = ("E", "A", "alpha", "B", "beta")
REQUIRED_KEYS = ("architecture", "params", "tokens", "flops", "loss")


_EXPONENTS, _OFFSETS = (0.0, 0.5, 1.0, 1.5, 2.0), (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
PAPER_GRID = np.array(list(itertools.product(_OFFSETS, _OFFSETS, (-1.0, -0.5, 0.0, 0.5, 1.0), _EXPONENTS,
                                             _EXPONENTS)))
"""The paper's 4500 starting points, as rows (a, b, e, alpha, beta)."""


@dataclass(frozen=True)
class LawFit:
    """L(N, D) = E + A/N^alpha + B/D^beta; `objective` is the summed Huber loss at the optimum."""
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    objective: float

    def predict(self, N: Any, D: Any) -> Any:
        N, D = np.asarray(N, dtype=float), np.asarray(D, dtype=float)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    def log_vector(self) -> np.ndarray:
        """(a, b, e, alpha, beta): the optimiser's coordinates, for warm starts."""
        with np.errstate(divide="ignore"):
            return np.array([np.log(self.A), np.log(self.B), np.log(self.E), self.alpha, self.beta])


class FrontierPoint(NamedTuple):
    """One point of a compute frontier: budget C, the N and D spending it, and the loss reached."""
    flops: float
    params: float
    tokens: float
    loss: float


def _log_predictions(a: Any, b: Any, e: Any, alpha: Any, beta: Any, log_n: np.ndarray,
                     log_d: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]:
    """log(sum exp t) for t = (a - alpha log N, b - beta log D, e), shifted by the largest term, with
    the parts the gradient reuses (scipy's logsumexp costs ~20x more on these tiny arrays)."""
    terms = (a - alpha * log_n, b - beta * log_d, e + 0 * log_n)
    top = np.maximum(np.maximum(terms[0], terms[1]), terms[2])
    shifted = tuple(np.exp(t - top) for t in terms)
    total = shifted[0] + shifted[1] + shifted[2]
    return top + np.log(total), shifted, total


def _huber_objective(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                     delta: float) -> tuple[float, np.ndarray]:
    """The approach-3 objective and its exact gradient (L-BFGS-B converges on it in ~100 steps)."""
    a, b, e, alpha, beta = x
    log_pred, shifted, total = _log_predictions(a, b, e, alpha, beta, log_n, log_d)
    residual = log_pred - log_l
    slope = np.clip(residual, -delta, delta) / total  # dHuber/dterm_j = slope * shifted_j
    s1, s2, s3 = (slope * w for w in shifted)
    grad = np.array([s1.sum(), s2.sum(), s3.sum(), -(s1 * log_n).sum(), -(s2 * log_d).sum()])
    return float(huber(delta, residual).sum()), grad


def _grid_objectives(starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray,
                     log_l: np.ndarray, delta: float) -> np.ndarray:
    """The objective at every starting point at once, to rank them before optimising."""
    a, b, e, alpha, beta = (starts[:, i:i + 1] for i in range(5))
    log_pred = _log_predictions(a, b, e, alpha, beta, log_n, log_d)[0]
    return huber(delta, log_pred - log_l).sum(axis=1)


def _as_logs(N: Any, D: Any, L: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = [np.asarray(v, dtype=float).ravel() for v in (N, D, L)]
    if len({len(a) for a in arrays}) != 1:
        raise ValueError(f"N, D and L differ in length: {[len(a) for a in arrays]}")
    if any((a <= 0).any() or not np.isfinite(a).all() for a in arrays):
        raise ValueError("N, D and L must be positive and finite (the fit is on their logarithms)")
    return tuple(np.log(a) for a in arrays)


def _best_local_fit(starts: np.ndarray, logs: tuple[np.ndarray, ...], delta: float) -> LawFit:
    """L-BFGS-B from every start; the lowest optimum wins.

    The optimiser works on centred logarithms (a - alpha mean(log N) in place of a, likewise b):
    the same objective, but a and alpha no longer move together along a ridge of slope ~15, which
    halves the iterations. The tolerances are far below scipy's defaults because with delta=1e-3
    the objective itself is ~1e-4, and the defaults stop while alpha still drifts in the 4th digit.
    """
    log_n, log_d, log_l = logs
    mean_n, mean_d = log_n.mean(), log_d.mean()
    best = None
    for x0 in starts:
        x0 = np.array(x0, dtype=float)
        x0[:2] -= x0[3:5] * (mean_n, mean_d)
        result = minimize(_huber_objective, x0, args=(log_n - mean_n, log_d - mean_d, log_l, delta),
                          jac=True, method="L-BFGS-B",
                          options={"maxiter": 1000, "ftol": 1e-13, "gtol": 1e-10})
        if np.isfinite(result.fun) and (best is None or result.fun < best.fun):
            best = result
    if best is None:
        raise ValueError("no initialisation gave a finite objective")
    a, b, e, alpha, beta = best.x
    a, b = a + alpha * mean_n, b + beta * mean_d
    with np.errstate(over="ignore"):
        E, A, B = (float(np.exp(v)) for v in (e, a, b))
    return LawFit(E=E, A=A, alpha=float(alpha), B=B, beta=float(beta), objective=float(best.fun))


def fit_law(N: Any, D: Any, L: Any, *, delta: float = HUBER_DELTA, inits: np.ndarray | None = None,
            n_starts: int | None = 30) -> LawFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta by Chinchilla's approach 3 (Hoffmann et al. 2022).

    Minimises sum_i Huber_delta(logsumexp(a - alpha log N_i, b - beta log D_i, e) - log L_i) over
    (a, b, e, alpha, beta), with E, A, B = exp(e), exp(a), exp(b), by L-BFGS-B from a grid of
    initialisations, keeping the best optimum: the objective is not convex and single starts land
    in poor local minima. delta=1e-3 follows the paper; it makes the fit nearly an L1 fit on
    log-loss, so one diverged or mislogged run cannot drag the exponents.

    `inits` are rows (a, b, e, alpha, beta), by default the paper's grid (alpha, beta in 0..2 by
    0.5, e in -1..1 by 0.5, a, b in 0..25 by 5). Optimising all 4500 takes minutes, so by default
    only the `n_starts` grid points with the lowest starting objective are optimised (the whole
    grid is still evaluated); n_starts=None optimises every one, as the paper does.
    """
    logs = _as_logs(N, D, L)
    starts = PAPER_GRID if inits is None else np.atleast_2d(np.asarray(inits, dtype=float))
    if n_starts is not None and len(starts) > n_starts:
        ranked = np.argsort(_grid_objectives(starts, *logs, delta), kind="stable")
        starts = starts[ranked[:n_starts]]
    return _best_local_fit(starts, logs, delta)


def bootstrap_fits(N: Any, D: Any, L: Any, *, n_boot: int = 200, seed: int = 0,
                   delta: float = HUBER_DELTA, start: LawFit | None = None,
                   n_grid_starts: int = 2) -> list[LawFit]:
    """Refits on runs resampled with replacement (the sampling noise of the ladder itself). Each
    starts from the full fit's optimum plus the `n_grid_starts` best grid points on its resample: a
    tenth of a full fit's cost, yet a resample whose optimum moved to another basin still finds it.
    Resamples with one distinct N or D cannot pin an exponent and are drawn again."""
    log_n, log_d, log_l = _as_logs(N, D, L)
    start = start or fit_law(np.exp(log_n), np.exp(log_d), np.exp(log_l), delta=delta)
    rng = np.random.default_rng(seed)
    fits: list[LawFit] = []
    for _ in range(n_boot):
        for _attempt in range(100):
            idx = rng.integers(0, len(log_n), len(log_n))
            if len(set(log_n[idx])) >= MIN_DISTINCT and len(set(log_d[idx])) >= MIN_DISTINCT:
                break
        logs = (log_n[idx], log_d[idx], log_l[idx])
        ranked = np.argsort(_grid_objectives(PAPER_GRID, *logs, delta), kind="stable")
        warm = [start.log_vector()] if np.isfinite(start.log_vector()).all() else []
        starts = np.vstack(warm + [PAPER_GRID[ranked[:max(n_grid_starts, 1 - len(warm))]]])
        fits.append(_best_local_fit(starts, logs, delta))
    return fits


def percentile_intervals(fits: Sequence[LawFit], level: float = 0.9) -> dict[str, tuple[float, float]]:
    """Equal-tailed percentile intervals of each law parameter over bootstrap fits."""
    tails = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    return {name: tuple(float(v) for v in np.percentile([getattr(f, name) for f in fits], tails))
            for name in LAW_PARAMETERS}


def bootstrap_intervals(N: Any, D: Any, L: Any, *, n_boot: int = 200, level: float = 0.9, seed: int = 0,
                        delta: float = HUBER_DELTA, start: LawFit | None = None) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap intervals {name: (lo, hi)} for E, A, B, alpha and beta; `start` (the
    full fit, if the caller has it) saves refitting it."""
    return percentile_intervals(bootstrap_fits(N, D, L, n_boot=n_boot, seed=seed, delta=delta, start=start),
                                level)


def frontier(fit: LawFit, k: float, C_values: Any) -> list[FrontierPoint]:
    """The compute-optimal (C, N_opt, D_opt, L_opt) for each budget, C = k N D.

    Closed form of approach 3: N_opt = G (C/k)^(beta/(alpha+beta)) with
    G = (alpha A / (beta B))^(1/(alpha+beta)), D_opt = (C/k)/N_opt. k is the architecture's FLOPs
    per parameter and token: 6 for a vanilla transformer, more for IIET, which runs each layer
    several times, so at equal C it affords fewer N*D.
    """
    if fit.alpha <= 0 or fit.beta <= 0:
        raise ValueError(f"no compute frontier: the fitted exponents alpha={fit.alpha:.3g}, "
                         f"beta={fit.beta:.3g} must both be positive")
    if k <= 0:
        raise ValueError(f"FLOPs per parameter and token must be positive, not {k}")
    total = fit.alpha + fit.beta
    G = (fit.alpha * fit.A / (fit.beta * fit.B)) ** (1 / total)
    C = np.atleast_1d(np.asarray(C_values, dtype=float))
    n_opt = G * (C / k) ** (fit.beta / total)
    d_opt = C / k / n_opt
    return [FrontierPoint(*map(float, point)) for point in zip(C, n_opt, d_opt, fit.predict(n_opt, d_opt))]


Rows = Sequence[Mapping[str, Any]]


def _columns(runs: Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.array([float(r[key]) for r in runs]) for key in ("params", "tokens", "loss"))


def _has_frontier(fit: LawFit | None) -> bool:
    return fit is not None and fit.alpha > 0 and fit.beta > 0


def flops_per_param_token(rows: Rows) -> float:
    """k = median(C / (N D)) over runs: the caller's FLOP count (every pass included) per unit of
    the law's N D, so the frontier spends budgets the way the runs actually did."""
    return float(np.median([float(r["flops"]) / (float(r["params"]) * float(r["tokens"])) for r in rows]))


def empirical_frontier(rows: Rows, *, bucket_decades: float = 0.25) -> list[FrontierPoint]:
    """The lowest-loss run in each FLOP bucket (log10 C rounded to `bucket_decades`): what the
    ladder actually reached, to hold the fitted frontier against."""
    best: dict[int, Mapping[str, Any]] = {}
    for row in rows:
        bucket = round(math.log10(float(row["flops"])) / bucket_decades)
        if bucket not in best or float(row["loss"]) < float(best[bucket]["loss"]):
            best[bucket] = row
    return [FrontierPoint(float(r["flops"]), float(r["params"]), float(r["tokens"]), float(r["loss"]))
            for _, r in sorted(best.items())]


@dataclass(frozen=True)
class ArchitectureFit:
    """One architecture's law, or the reason it has none (`fit` is None, `reason` says why)."""
    architecture: str
    n_runs: int
    fit: LawFit | None
    intervals: dict[str, tuple[float, float]]
    k: float  # FLOPs per parameter and token
    residuals: tuple[float, ...]  # log L - log L_hat, in the order of this architecture's rows
    empirical_frontier: tuple[FrontierPoint, ...]
    bootstrap: tuple[LawFit, ...] = ()
    reason: str | None = None

    @property
    def rms_residual(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.residuals)))) if self.residuals else math.nan

    def frontier_loss(self, C: float, level: float = 0.9) -> tuple[float, float, float] | None:
        """(L_opt, lo, hi) at budget C, the interval over the bootstrap fits; None if no frontier."""
        if not _has_frontier(self.fit):
            return None
        boots = [frontier(f, self.k, [C])[0].loss for f in self.bootstrap if _has_frontier(f)] or [math.nan]
        lo, hi = np.percentile(boots, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
        return frontier(self.fit, self.k, [C])[0].loss, float(lo), float(hi)


@dataclass(frozen=True)
class SweepFit:
    """Per-architecture fits of one sweep, keyed by architecture name (sorted)."""
    architectures: dict[str, ArchitectureFit]
    level: float

    def fitted(self) -> list[ArchitectureFit]:
        return [a for a in self.architectures.values() if a.fit is not None]


def _by_architecture(rows: Rows) -> dict[str, list[Mapping[str, Any]]]:
    """Rows grouped by architecture (sorted), each checked: a missing key or a non-positive number
    is a one-line error naming the run, not a NaN deep inside the optimiser."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for i, row in enumerate(rows):
        missing = [key for key in REQUIRED_KEYS if key not in row]
        bad = [key for key in REQUIRED_KEYS[1:] if key in row and not 0 < float(row[key]) < math.inf]
        if missing or bad:
            raise ValueError(f"run {i}: " + "; ".join([f"lacks {key}" for key in missing]
                                                       + [f"{key} must be positive and finite" for key in bad]))
        groups.setdefault(str(row["architecture"]), []).append(row)
    return dict(sorted(groups.items()))


def _too_few_runs(runs: Rows) -> str | None:
    n_values, d_values = {float(r["params"]) for r in runs}, {float(r["tokens"]) for r in runs}
    if len(runs) >= MIN_RUNS and len(n_values) >= MIN_DISTINCT and len(d_values) >= MIN_DISTINCT:
        return None
    return (f"not enough runs to fit: {len(runs)} runs, {len(n_values)} distinct N, {len(d_values)} "
            f"distinct D (need >= {MIN_RUNS} runs, >= {MIN_DISTINCT} distinct N and D)")


def fit_sweep(rows: Rows, *, n_boot: int = 200, seed: int = 0, level: float = 0.9,
              delta: float = HUBER_DELTA, k: Mapping[str, float] | None = None) -> SweepFit:
    """Fit every architecture of a sweep; one with too few runs is reported, not raised, so a
    half-finished ladder still gives the fits it can. `k` maps architecture -> FLOPs per parameter
    and token; by default it is estimated from the rows (flops_per_param_token)."""
    results: dict[str, ArchitectureFit] = {}
    for index, (name, runs) in enumerate(_by_architecture(rows).items()):
        arch_k = float(k[name]) if k and name in k else flops_per_param_token(runs)
        observed = tuple(empirical_frontier(runs))
        reason = _too_few_runs(runs)
        if reason is not None:
            results[name] = ArchitectureFit(name, len(runs), None, {}, arch_k, (), observed, reason=reason)
            continue
        N, D, L = _columns(runs)
        law = fit_law(N, D, L, delta=delta)
        boots = tuple(bootstrap_fits(N, D, L, n_boot=n_boot, seed=seed + index, delta=delta, start=law))
        residuals = tuple(float(v) for v in np.log(L) - np.log(law.predict(N, D)))
        results[name] = ArchitectureFit(name, len(runs), law, percentile_intervals(boots, level) if boots else {},
                                        arch_k, residuals, observed, boots)
    return SweepFit(results, level)


def _new_axes(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel, xscale="log")
    axes.grid(True, which="both", alpha=0.3)
    return figure, axes


def _save_png(figure: Figure, axes: Any, path: Any) -> None:
    """Render to memory, then write atomically: a reader never sees half a PNG."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    write_bytes_atomic(path, buffer.getvalue())


def plot_loss_vs_flops(rows: Rows, sweep_fit: SweepFit, path: Any) -> None:
    """Runs as points, each architecture's fitted frontier L(C) as a line, and its empirical
    frontier (runs no cheaper run beats) dotted: the plot that shows whether an advantage grows."""
    figure, axes = _new_axes("Loss vs training compute", "training FLOPs C", "validation loss")
    for i, (name, runs) in enumerate(_by_architecture(rows).items()):
        colour, flops = f"C{i % 10}", np.array([float(r["flops"]) for r in runs])
        axes.scatter(flops, [float(r["loss"]) for r in runs], s=14, color=colour, label=name)
        result = sweep_fit.architectures.get(name)
        if result is not None and _has_frontier(result.fit):
            budgets = np.geomspace(flops.min() / 2, flops.max() * 2, 100)
            axes.plot(budgets, [p.loss for p in frontier(result.fit, result.k, budgets)],
                      color=colour, label=f"{name} fitted frontier")
        pareto = [p for j, p in enumerate(result.empirical_frontier if result else ())
                  if all(p.loss < q.loss for q in result.empirical_frontier[:j])]
        if len(pareto) > 1:
            axes.plot([p.flops for p in pareto], [p.loss for p in pareto], ":", color=colour)
    _save_png(figure, axes, path)


def plot_loss_vs_tokens(rows: Rows, path: Any) -> None:
    """One colour and label per (architecture, size), one line style per architecture: the runs'
    loss curves where the rows carry them, else the final losses joined across token budgets."""
    figure, axes = _new_axes("Loss vs training tokens", "training tokens D", "validation loss")
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        size = str(row.get("size") or f"N={float(row['params']):.3g}")
        groups.setdefault((str(row["architecture"]), size), []).append(row)
    architectures = sorted({name for name, _ in groups})
    for j, ((name, size), runs) in enumerate(sorted(groups.items())):
        style, label = ("-", "--", "-.", ":")[architectures.index(name) % 4], f"{name} {size}"
        curves = [sorted((float(t), float(v)) for t, v in r["loss_curve"]) for r in runs if r.get("loss_curve")]
        for curve in curves or [sorted((float(r["tokens"]), float(r["loss"])) for r in runs)]:
            axes.plot(*zip(*curve), style, color=f"C{j % 10}", marker="." if len(curve) < 20 else None,
                      label=label)
            label = None
    _save_png(figure, axes, path)


def plot_residuals(rows: Rows, sweep_fit: SweepFit, path: Any) -> None:
    """log L - log L_hat against N per fitted architecture: a trend here means the law's form,
    not noise, is what separates runs (e.g. the smallest sizes bending away)."""
    figure, axes = _new_axes("Residuals of the fitted law", "non-embedding parameters N", "log L - log L_hat")
    for i, (name, runs) in enumerate(_by_architecture(rows).items()):
        result = sweep_fit.architectures.get(name)
        if result is not None and result.fit is not None:
            N, D, L = _columns(runs)
            axes.scatter(N, np.log(L) - np.log(result.fit.predict(N, D)), s=14, color=f"C{i % 10}",
                         label=f"{name} (RMS {result.rms_residual:.3g})")
    axes.axhline(0.0, color="black", linewidth=0.8)
    _save_png(figure, axes, path)


def _with_interval(value: float, interval: Sequence[float] | None) -> str:
    return f"{value:.4g}" if interval is None else f"{value:.4g} [{interval[0]:.4g}, {interval[1]:.4g}]"


def report_budgets(rows: Rows, *, most: int = 5) -> list[float]:
    """Up to `most` powers of ten from the smallest run's FLOPs to a decade past the largest."""
    logs = [math.log10(float(r["flops"])) for r in rows]
    powers = list(range(math.ceil(min(logs)), math.floor(max(logs)) + 2))
    picks = sorted({powers[round(i)] for i in np.linspace(0, len(powers) - 1, min(most, len(powers)))})
    return [10.0 ** p for p in picks]


def optimum_outside_runs(result: ArchitectureFit, rows: Rows, C: float) -> bool:
    """Whether the law's compute-optimal N or D at budget C lies outside the N and D this
    architecture's runs covered: there the frontier is the law's shape extrapolated (a law with
    alpha ~ 0, loss flat in N, puts every budget into tokens at a vanishing N), not a measurement."""
    if not _has_frontier(result.fit):
        return False
    mine = [r for r in rows if str(r["architecture"]) == result.architecture]
    point = frontier(result.fit, result.k, [C])[0]
    n_run, d_run = [float(r["params"]) for r in mine], [float(r["tokens"]) for r in mine]
    return not (min(n_run) <= point.params <= max(n_run) and min(d_run) <= point.tokens <= max(d_run))


def _frontier_table(rows: Rows, sweep_fit: SweepFit, budgets: Sequence[float], pct: str) -> list[str]:
    fitted, largest = sweep_fit.fitted(), max(float(r["flops"]) for r in rows)
    lines = ["## Fitted compute frontier L(C)", "",
             f"Loss at the compute-optimal N and D of each budget, with {pct} bootstrap intervals; budgets "
             "marked * lie beyond the largest run (extrapolation). A loss marked † has its optimal N or D "
             "outside the sizes and tokens that architecture ran: the law's shape extrapolated, not a "
             "measurement, and never called 'lowest'. 'lowest' is marked (overlap) when its interval "
             "overlaps another architecture's: the ladder cannot tell them apart there.", "",
             "| C (FLOPs) | " + " | ".join(a.architecture for a in fitted) + " | lowest |",
             "|---" * (len(fitted) + 2) + "|"]
    for C in budgets:
        values = {a.architecture: a.frontier_loss(C, sweep_fit.level) for a in fitted}
        outside = {a.architecture: optimum_outside_runs(a, rows, C) for a in fitted}
        known = {name: v for name, v in values.items() if v is not None and not outside[name]}
        lowest = min(known, key=lambda name: known[name][0]) if known else None
        overlap = lowest is not None and any(v[1] <= known[lowest][2] for n, v in known.items() if n != lowest)
        cells = ["n/a" if v is None else _with_interval(v[0], v[1:]) + (" †" if outside[name] else "")
                 for name, v in values.items()]
        lines.append(f"| {C:.3g}{'*' if C > largest else ''} | {' | '.join(cells)} | "
                     f"{lowest or 'n/a'}{' (overlap)' if overlap else ''} |")
    return lines


def report_markdown(rows: Rows, sweep_fit: SweepFit, budgets: Sequence[float] | None = None) -> str:
    """The fitted laws with intervals, the warnings a reader needs before trusting them, and the
    architectures' fitted frontier losses side by side at a few compute budgets."""
    pct = f"{100 * sweep_fit.level:.0f}%"
    lines = ["## Fitted laws: L(N, D) = E + A/N^alpha + B/D^beta", "",
             f"Chinchilla approach 3 (Huber loss on log-loss); brackets are {pct} bootstrap intervals.", "",
             "| architecture | runs | E | A | alpha | B | beta | k (FLOPs/(N D)) | RMS residual |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for result in sweep_fit.architectures.values():
        if result.fit is None:
            notes.append(f"- **{result.architecture}**: {result.reason}.")
            continue
        cells = [_with_interval(getattr(result.fit, p), result.intervals.get(p)) for p in LAW_PARAMETERS]
        lines.append(f"| {result.architecture} | {result.n_runs} | {' | '.join(cells)} | {result.k:.4g} | "
                     f"{result.rms_residual:.3g} |")
        for exponent in ("alpha", "beta"):
            lo, hi = result.intervals.get(exponent, (math.nan, math.nan))
            if not hi - lo <= WIDE_EXPONENT_INTERVAL:
                notes.append(f"- **{result.architecture}**: the {pct} interval of {exponent}, [{lo:.3g}, {hi:.3g}], "
                             f"is wider than {WIDE_EXPONENT_INTERVAL}: the ladder is too small to pin the exponent; "
                             "do not read differences in it (or extrapolations from it) as real.")
        if not _has_frontier(result.fit):
            notes.append(f"- **{result.architecture}**: a non-positive exponent leaves no compute frontier.")
    lines += [""] + (notes + [""] if notes else [])
    if not sweep_fit.fitted():
        return "\n".join(lines + ["No architecture could be fitted, so there is no frontier to compare."]) + "\n"
    budgets = list(budgets) if budgets is not None else report_budgets(rows)
    return "\n".join(lines + _frontier_table(rows, sweep_fit, budgets, pct)) + "\n"
