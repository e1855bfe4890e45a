"""Issue 31's trained-regime comparison, from the committed results (results/trained/CELL/
results.json, written by `bash examples/trained_regime.sh collect CELL`): per cell the LR grid,
the seeds at each architecture's best LR, the unigram plateau of every run, the losses at equal
tokens and at equal FLOPs, and PNG curves (docs/img/trained_CELL_*.png). Prints markdown for
docs/scaling.md.

    python examples/trained_regime_report.py [CELL ...]      # default: every committed cell
    python examples/trained_regime_report.py --compare CELL_A CELL_B   # paired by seed, by window
    python examples/trained_regime_report.py --tail-gain [CELL ...]     # the decay's gain by LR
    python examples/trained_regime_report.py --iiad CELL         # E-IIET students' share kept
    python examples/trained_regime_report.py --train-vs-heldout CELL  # IIET's lead, seen vs unseen
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from megatron_iiet.sweep.curves import at_equal_x, plateau, unigram_entropy

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results" / "trained"
TRAIN_DATA = REPO / "outputs" / "cpu_compare" / "data" / "gutenberg_train_long"
ARCHS = ("vanilla", "pcformer_rk2", "iiet")


def entropy() -> float:
    """The training tokens' unigram entropy: computed once from the data, then committed."""
    saved = RESULTS / "unigram_entropy.json"
    if saved.is_file():
        return json.loads(saved.read_text())["nats"]
    value = unigram_entropy(str(TRAIN_DATA))
    saved.write_text(json.dumps({"data": TRAIN_DATA.name, "nats": value}) + "\n")
    return value


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f} ({len(values)} seeds)"


def best_lr(runs: list[dict], arch: str) -> tuple[float, str]:
    """The grid LR of lowest mean held-out loss, and whether it lies inside the grid run so far;
    in a cell that fixes the architecture's LR (``lr.values``, carried from another cell), that
    LR."""
    by_lr: dict[float, list[float]] = {}
    for r in runs:
        if r["architecture"] == arch and r["grid"] and r["valid_loss"] is not None:
            by_lr.setdefault(r["lr"], []).append(r["valid_loss"])
    if not by_lr:
        fixed = {r["lr"] for r in runs if r["architecture"] == arch}
        if len(fixed) != 1:
            raise ValueError(f"{arch}: no grid runs and {len(fixed)} LRs")
        return fixed.pop(), "no: a fixed LR, not tuned in this cell"
    lrs = sorted(by_lr)
    best = min(lrs, key=lambda lr: statistics.mean(by_lr[lr]))
    if len(lrs) < 3:
        return best, f"no: {len(lrs)} grid LR{'s' if len(lrs) > 1 else ''}, so the best is at an edge"
    return best, "yes" if 0 < lrs.index(best) < len(lrs) - 1 else "no: at its edge"


def finished_runs(cell: str, results: Path = RESULTS) -> list[dict]:
    """The cell's committed runs that finished."""
    return [r for r in json.loads((results / cell / "results.json").read_text())
            if r["status"] == "finished"]


def at_best_lr(runs: list[dict]) -> dict[str, tuple[float, str, dict[int, dict]]]:
    """Per architecture of the cell: its best LR, whether that lies inside the grid, and its runs
    at that LR by seed."""
    out = {}
    for arch in ARCHS:
        if any(r["architecture"] == arch for r in runs):
            lr, inside = best_lr(runs, arch)
            out[arch] = (lr, inside, {r["seed"]: r for r in runs
                                      if r["architecture"] == arch and r["lr"] == lr})
    return out


def mean_curve(curves: list[list]) -> list[tuple[float, float]]:
    """The seeds' mean held-out curve, over the token counts every seed reached."""
    points = min(len(c) for c in curves)
    return [(curves[0][i][0], statistics.mean(c[i][1] for c in curves)) for i in range(points)]


def seed_test_lines(runs: list[dict]) -> list[str]:
    """At each architecture's best LR, for every pair with at least two seeds each: Welch's t-test
    on the held-out losses, and (where the pair shares two or more seeds) the paired t-test on the
    per-seed differences, at the end and along the run; a seed fixes the data order, so pairing
    removes that part of the noise. Both from scipy; they say whether a gap is larger than the
    seeds' spread."""
    from itertools import combinations

    from scipy.stats import ttest_ind

    at_best = {arch: by_seed for arch, (_, _, by_seed) in at_best_lr(runs).items()}
    welch, paired, along = [], [], []
    for a, b in combinations([a for a, v in at_best.items() if len(v) >= 2], 2):
        va = [r["valid_loss"] for r in at_best[a].values()]
        vb = [r["valid_loss"] for r in at_best[b].values()]
        result = ttest_ind(va, vb, equal_var=False)
        gap = statistics.mean(va) - statistics.mean(vb)
        welch.append(f"{a} - {b} {gap:+.3f} (t = {result.statistic:.2f}, p = {result.pvalue:.2f})")
        seeds = sorted(set(at_best[a]) & set(at_best[b]))
        if len(seeds) >= 2:
            diffs = [at_best[a][s]["valid_loss"] - at_best[b][s]["valid_loss"] for s in seeds]
            mean, t, p = paired_gap(diffs)
            paired.append(f"{a} - {b} " + " / ".join(f"{d:+.3f}" for d in diffs)
                          + f" (mean {mean:+.3f}, t = {t:.2f}, p = {p:.2f}, {len(seeds)} seeds)")
            along.append(f"{a} - {b}: " + "; ".join(
                curve_gap_points([at_best[a][s]["loss_curve"] for s in seeds],
                                 [at_best[b][s]["loss_curve"] for s in seeds])))
    lines = ["", "Welch's t-test at the best LRs: " + "; ".join(welch)] if welch else []
    if paired:
        lines += ["", "Paired by seed at the best LRs: " + "; ".join(paired),
                  "", "Along the run, paired by seed (tokens: mean ± sd of the differences, p):",
                  *[f"- {line}" for line in along]]
    return lines


def paired_gap(diffs: list[float]) -> tuple[float, float, float]:
    """Mean, t and two-sided p of per-seed differences (scipy's one-sample t-test against 0,
    the same as its paired test on the two columns)."""
    from scipy.stats import ttest_1samp

    result = ttest_1samp(diffs, 0.0)
    return statistics.mean(diffs), float(result.statistic), float(result.pvalue)


def curve_gap_points(curves_a: list[list], curves_b: list[list], every: int = 3) -> list[str]:
    """Held-out loss of A minus B seed by seed at the validations both reached: every `every`-th
    token count and the last, as mean ± sd of the per-seed differences with the paired p."""
    shared = set.intersection(*[{t for t, _ in c} for c in curves_a + curves_b])
    tokens = sorted(shared)
    if not tokens:
        return ["no validation token count shared by every seed"]
    picks = tokens[::every] + ([tokens[-1]] if (len(tokens) - 1) % every else [])
    as_dicts = [dict(map(tuple, c)) for c in curves_a], [dict(map(tuple, c)) for c in curves_b]
    points = []
    for t in picks:
        diffs = [ca[t] - cb[t] for ca, cb in zip(*as_dicts)]
        mean, _, p = paired_gap(diffs)
        points.append(f"{t / 1e6:.1f}M {mean:+.3f} ± {statistics.stdev(diffs):.3f} (p = {p:.2f})")
    return points


def report(cell: str, H: float) -> str:
    runs = finished_runs(cell)
    lines = [f"### Cell {cell}", "",
             "| run | LR | held-out loss | WikiText-2 loss | FLOPs | plateau steps (fraction) |",
             "|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (ARCHS.index(r["architecture"]), r["lr"], r["seed"])):
        p = plateau(r["train_curve"], H, total_steps=r["train_steps"])
        wiki = r.get("valid_loss_wikitext")
        lines.append(f"| {r['name']} | {r['lr']:.3g} | {r['valid_loss']:.4f} | "
                     f"{'-' if wiki is None else f'{wiki:.4f}'} | {r['flops']:.3g} | "
                     f"{p.steps} ({p.fraction:.1%}) |")
    lines += ["", "| architecture | best LR (inside the grid?) | held-out at best | "
              "WikiText-2 at best |", "|---|---|---|---|"]
    curves_tokens, curves_flops = {}, {}
    for arch, (lr, bracketed, by_seed) in at_best_lr(runs).items():
        at_best = list(by_seed.values())
        wiki = [r["valid_loss_wikitext"] for r in at_best if r.get("valid_loss_wikitext")]
        lines.append(f"| {arch} | {lr:.3g} ({bracketed}) | "
                     f"{mean_sd([r['valid_loss'] for r in at_best])} | "
                     f"{mean_sd(wiki) if wiki else '-'} |")
        curve = mean_curve([r["loss_curve"] for r in at_best])
        curves_tokens[arch] = curve
        curves_flops[arch] = [(t * at_best[0]["flops_per_token"], v) for t, v in curve]
    lines += seed_test_lines(runs)
    lines += wikitext_curve_lines(cell, runs)
    if curves_flops:
        budget = min(c[-1][0] for c in curves_flops.values())
        equal = at_equal_x(curves_flops, budget)
        lines += ["", f"At equal FLOPs ({budget:.3g}, the smallest run's total), held-out loss: "
                  + ", ".join(f"{a} {v:.3f}" for a, v in equal.items() if v is not None)]
        _plot(cell, curves_tokens, curves_flops, H)
    return "\n".join(lines)


def wikitext_curve_lines(cell: str, runs: list[dict],
                         img: Path = REPO / "docs" / "img") -> list[str]:
    """WikiText-2 (out of domain) along the run, from the checkpoints each run kept (``collect
    --extra-valid``; only runs collected where their checkpoints still were have it): each
    architecture at its best LR, mean over the seeds with a curve, at the token counts every one
    of them has, and each minus vanilla paired by seed. Draws ``img``/trained_CELL_wikitext.png."""
    with_curve = {}
    for arch, (_, _, by_seed) in at_best_lr(runs).items():
        seeds = {seed: dict(map(tuple, r["loss_curve_wikitext"])) for seed, r in by_seed.items()
                 if r.get("loss_curve_wikitext")}
        if seeds:
            with_curve[arch] = seeds
    if not with_curve:
        return []
    points = sorted(set.intersection(*(set(c) for s in with_curve.values() for c in s.values())))
    # the last quarter's checkpoint sits a step or two before the final one: keep the final
    points = [t for i, t in enumerate(points) if i + 1 == len(points) or points[i + 1] > 1.005 * t]
    if not points:  # the runs kept no checkpoint at a common token count
        return []
    mean = {a: [statistics.mean(c[t] for c in s.values()) for t in points]
            for a, s in with_curve.items()}
    lines = ["", "WikiText-2 loss at the kept checkpoints, best LR each (mean over the seeds "
             "listed; minus vanilla paired by seed)", "",
             "| tokens | " + " | ".join(f"{a} (seeds {', '.join(map(str, sorted(s)))})"
                                       for a, s in with_curve.items()) + " |",
             "|---|" + "---|" * len(with_curve)]
    base = with_curve.get("vanilla", {})
    for i, t in enumerate(points):
        cells = []
        for arch, seeds in with_curve.items():
            shared = sorted(set(seeds) & set(base)) if arch != "vanilla" else []
            gap = [seeds[s][t] - base[s][t] for s in shared]
            cells.append(f"{mean[arch][i]:.3f}" + (
                f" ({statistics.mean(gap):+.3f}" + (f" ± {statistics.stdev(gap):.3f}"
                                                     if len(gap) > 1 else "") + ")" if gap else ""))
        lines.append(f"| {t / 1e6:.2f}M | " + " | ".join(cells) + " |")
    flops = {a: next(r["flops_per_token"] for r in runs if r["architecture"] == a) for a in mean}
    _plot_wikitext({a: list(zip(points, v)) for a, v in mean.items()}, flops, cell,
                   img / f"trained_{cell}_wikitext.png")
    return lines


def _plot_wikitext(by_tokens: dict, flops_per_token: dict, cell: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(figure)
    for i, (scale, xlabel) in enumerate(((lambda a: 1.0, "training tokens"),
                                         (lambda a: flops_per_token[a], "training FLOPs"))):
        axes = figure.add_subplot(1, 2, i + 1)
        for arch, points in by_tokens.items():
            axes.plot([t * scale(arch) for t, _ in points], [v for _, v in points], marker="o",
                      label=arch)
        axes.set(xlabel=xlabel, ylabel="WikiText-2 loss (out of domain)",
                 title=f"{cell}, best LR each, at the kept checkpoints")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def _plot(cell: str, by_tokens, by_flops, H: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4), dpi=100)
    FigureCanvasAgg(figure)
    for i, (curves, xlabel) in enumerate(((by_tokens, "training tokens"),
                                          (by_flops, "training FLOPs"))):
        axes = figure.add_subplot(1, 3, i + 1)
        for arch, points in curves.items():
            axes.plot(*zip(*points), label=arch)
        axes.axhline(H, color="grey", linestyle=":", label="unigram entropy")
        axes.set(xlabel=xlabel, ylabel="held-out loss", title=f"{cell}, best LR each (seed mean)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    if "vanilla" in by_tokens:  # the gaps the curves above are too close to show
        axes = figure.add_subplot(1, 3, 3)
        base = dict(by_tokens["vanilla"])
        axes.axhline(0, color="C0", label="vanilla")
        for i, (arch, points) in enumerate(by_tokens.items()):
            gap = [(t, v - base[t]) for t, v in points if t in base]
            if arch != "vanilla":
                axes.plot(*zip(*gap), color=f"C{i}", label=f"{arch} - vanilla")
        axes.set(xlabel="training tokens", ylabel="held-out loss minus vanilla's",
                 title="the gap at equal tokens", ylim=(-0.25, 0.5))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(REPO / "docs" / "img" / f"trained_{cell}.png")


def compare(cell_a: str, cell_b: str, windows: int = 4, results: Path = RESULTS) -> str:
    """Each architecture at its best LR in two cells of equal tokens (e.g. our recipe and the
    release's), paired by seed: the same initialisation and data order, so the per-seed
    difference carries less noise than the two means do (paired t-test, scipy). Then the same
    pairs by window of tokens, on the training batches and on the held-out book."""
    def best_by_seed(cell):
        best = at_best_lr(finished_runs(cell, results))
        return {arch: (lr, by_seed) for arch, (lr, _, by_seed) in best.items()}

    a, b = best_by_seed(cell_a), best_by_seed(cell_b)
    lines = [f"### {cell_b} minus {cell_a}, each at its best LR, paired by seed", "",
             "| architecture | LRs | per seed | mean (paired t-test) |", "|---|---|---|---|"]
    windowed = []
    for arch in ARCHS:
        if arch not in a or arch not in b:
            continue
        seeds = sorted(set(a[arch][1]) & set(b[arch][1]))
        diffs = [b[arch][1][s]["valid_loss"] - a[arch][1][s]["valid_loss"] for s in seeds]
        test = ""
        if len(seeds) >= 2:
            _, t, p = paired_gap(diffs)
            test = f" ± {statistics.stdev(diffs):.3f} (t = {t:.2f}, p = {p:.2f})"
        lines.append(f"| {arch} | {a[arch][0]:.3g} / {b[arch][0]:.3g} | "
                     + ", ".join(f"{s}: {d:+.3f}" for s, d in zip(seeds, diffs))
                     + f" | {statistics.mean(diffs):+.3f}{test} |")
        pairs = [(b[arch][1][s], a[arch][1][s]) for s in seeds]
        windowed += window_rows(arch, pairs, token_windows(pairs, windows))
    return "\n".join(lines + ["", f"{cell_b} minus {cell_a} by window of tokens, " + WINDOW_NOTE,
                              ""] + WINDOW_HEADER + windowed)


def iiad_share(cell: str, results: Path = RESULTS) -> str:
    """Issue 31.5: each E-IIET student of the cell (``examples/iiad_trained.py --collect``)
    against its own IIET run and vanilla at its best LR (seed mean), at equal tokens: the share of
    IIET's gain over vanilla the student keeps, (vanilla - student) / (vanilla - IIET)."""
    runs = {r["name"]: r for r in json.loads((results / cell / "results.json").read_text())
            if r["status"] == "finished"}
    lr, _ = best_lr(list(runs.values()), "vanilla")
    seeds = [r["valid_loss"] for r in runs.values()
             if r["architecture"] == "vanilla" and r["lr"] == lr]
    vanilla = statistics.mean(seeds)
    lines = [f"### IIAD in {cell}: against vanilla {lr:.3g}, {mean_sd(seeds)}", "",
             "| student | plan (passes) | teacher | held-out | its IIET run | IIET's gain over "
             "vanilla | share kept |", "|---|---|---|---|---|---|---|"]
    windowed = []
    for path in sorted((results / cell).glob("iiad_*.json")):
        student = json.loads(path.read_text())
        iiet = runs.get(student["iiet_run"])
        if iiet is None:
            lines.append(f"| {student['name']} | | | {student['valid_loss']:.4f} | "
                         f"{student['iiet_run']} not in the cell's results | | |")
            continue
        windowed += student_against_its_run(student, iiet)
        gain = vanilla - iiet["valid_loss"]
        share = (f"{(vanilla - student['valid_loss']) / gain:.0%}" if gain > 0
                 else "- (IIET does not lead)")
        lines.append(f"| {student['name']} | {student['plan']} ({student['passes']} of "
                     f"{student['full_passes']}) | {student['teacher'] or '-'} | "
                     f"{student['valid_loss']:.4f} | {iiet['valid_loss']:.4f} | {gain:+.4f} | "
                     f"{share} |")
    if windowed:
        lines += ["", "Each student minus its IIET run by window of its quarter, on the same "
                  "training batches (cross entropy) and on the held-out book", "",
                  "| student" + WINDOW_HEADER[0][len("| architecture"):], WINDOW_HEADER[1]]
        lines += windowed
    return "\n".join(lines)


def student_against_its_run(student: dict, iiet: dict, windows: int = 3) -> list[str]:
    """The student minus the IIET run it continues, over the student's steps: the two see the
    same batches, so a held-out gap that grows while the training one shrinks is the student
    generalising worse, not fitting worse. A student collected without the cross entropy on its
    training batches (only its distillation objective) gets no rows."""
    if "train_curve" not in student:
        return []
    per_step = student["tokens"] / student["train_steps"]
    as_run = {"tokens": student["tokens"], "train_steps": student["train_steps"],
              "train_curve": student["train_curve"],
              "loss_curve": [(step * per_step, loss) for step, loss in student["valid_curve"]]}
    first, last = student["switch_step"] * per_step, student["tokens"]
    edges = [first + (last - first) * i / windows for i in range(windows + 1)]
    return window_rows(student["name"], [(as_run, iiet)], edges)


def tail_gain(cells: list[str], from_fraction: float = 0.6, results: Path = RESULTS) -> str:
    """How much each run's held-out loss falls over the last 40% of its tokens (most of the LR's
    decay), by architecture and peak LR, mean over the seeds run there: whether the late gain
    follows the architecture or the LR. One column per peak LR any of the cells ran."""
    gains: dict[tuple[str, str], dict[float, list[float]]] = {}
    for cell in cells:
        for r in json.loads((results / cell / "results.json").read_text()):
            if r["status"] != "finished" or r["lr"] is None:
                continue
            curve = r["loss_curve"]
            mid = at_equal_x({"run": curve}, from_fraction * curve[-1][0])["run"]
            gains.setdefault((cell, r["architecture"]), {}).setdefault(r["lr"], []).append(
                mid - curve[-1][1])
    lrs = sorted({lr for by_lr in gains.values() for lr in by_lr})
    lines = [f"Held-out loss gained from {from_fraction:.0%} of the tokens to the end "
             "(mean over seeds; seeds in brackets)", "",
             "| cell | architecture | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " |",
             "|---|---|" + "---|" * len(lrs)]
    for cell in cells:
        for arch in ARCHS:
            by_lr = gains.get((cell, arch))
            if by_lr:
                lines.append(f"| {cell} | {arch} | " + " | ".join(
                    f"{statistics.mean(by_lr[lr]):.3f} ({len(by_lr[lr])})" if lr in by_lr else ""
                    for lr in lrs) + " |")
    return "\n".join(lines)


WINDOW_NOTE = ("paired by seed (mean over seeds; per seed in brackets), training batches "
               "against the held-out book")
WINDOW_HEADER = ["| architecture | tokens | on training batches | on the held-out book | "
                 "held-out minus training |", "|---|---|---|---|---|"]


def train_and_heldout_curves(r: dict) -> tuple[dict[float, float], dict[float, float]]:
    """A run's training and held-out losses by tokens seen."""
    per_step = r["tokens"] / r["train_steps"]
    return ({step * per_step: loss for step, loss in r["train_curve"]},
            dict(map(tuple, r["loss_curve"])))


def token_windows(pairs: list[tuple[dict, dict]], windows: int) -> list[float]:
    """The edges of ``windows`` equal windows of the runs' tokens from 20% (past the warm-up's
    spikes)."""
    total = max(r["tokens"] for pair in pairs for r in pair)
    return [total * (0.2 + 0.8 * i / windows) for i in range(windows + 1)]


def window_rows(label: str, pairs: list[tuple[dict, dict]], edges: list[float]) -> list[str]:
    """First minus second run of each pair (one pair per seed: the same training batches in
    both), on the training batches and on the held-out book, averaged inside each window of
    tokens per seed, then over the seeds."""
    def window_mean(a: dict, b: dict, lo: float, hi: float) -> float | None:
        shared = [t for t in a if lo < t <= hi and t in b]
        return statistics.mean(a[t] - b[t] for t in shared) if shared else None

    curves = [(train_and_heldout_curves(x), train_and_heldout_curves(y)) for x, y in pairs]
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        train, held = [], []
        for (train_x, held_x), (train_y, held_y) in curves:
            t = window_mean(train_x, train_y, lo, hi)
            h = window_mean(held_x, held_y, lo, hi)
            if t is not None and h is not None:
                train.append(t)
                held.append(h)
        if not train:
            continue
        cells = [f"{statistics.mean(v):+.3f} ({' / '.join(f'{x:+.3f}' for x in v)})"
                 for v in (train, held)]
        gap = statistics.mean(h - t for h, t in zip(held, train))
        rows.append(f"| {label} | {lo / 1e6:.1f}M-{hi / 1e6:.1f}M | {cells[0]} | {cells[1]} | "
                    f"{gap:+.3f} |")
    return rows


def train_against_heldout(cell: str, windows: int = 4, results: Path = RESULTS) -> str:
    """IIET minus each baseline, paired by seed at each architecture's best LR, on the training
    batches (the same batches for every architecture of a seed: one data order) and on the
    held-out book, by window of the run's tokens. Where the held-out difference exceeds the
    training one, IIET fits the books it trains on better than it transfers to unseen text,
    relative to that baseline: with repeated epochs, one way a lead on training batches fails
    to show on held-out text."""
    runs = finished_runs(cell, results)
    best = at_best_lr(runs)
    if "iiet" not in best:
        return f"{cell}: no finished IIET run"
    lines = [f"IIET minus each baseline in {cell}, " + WINDOW_NOTE, ""] + WINDOW_HEADER
    iiet = best["iiet"][2]
    for other in (a for a in ARCHS if a != "iiet" and a in best):
        baseline = best[other][2]
        pairs = [(iiet[seed], baseline[seed]) for seed in sorted(set(iiet) & set(baseline))]
        if pairs:
            lines += window_rows(other, pairs, token_windows(pairs, windows))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cells", nargs="*", metavar="CELL",
                        help="committed cells (results/trained/CELL); default: every one")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tail-gain", action="store_true",
                      help="the loss each run gains over its last 40%% of tokens, by peak LR")
    mode.add_argument("--iiad", action="store_true",
                      help="the E-IIET students of each cell: the share of IIET's gain kept")
    mode.add_argument("--train-vs-heldout", action="store_true",
                      help="IIET minus each baseline on training batches and on held-out text")
    mode.add_argument("--compare", action="store_true",
                      help="two cells (CELL_A CELL_B), paired by seed")
    args = parser.parse_args(argv)
    committed = sorted(p.name for p in RESULTS.iterdir() if (p / "results.json").is_file())
    unknown = [c for c in args.cells if c not in committed]
    if unknown:
        parser.exit(2, f"error: no committed results for {', '.join(unknown)} "
                       f"(cells: {', '.join(committed)})\n")
    if args.tail_gain:
        print(tail_gain(args.cells or ["xs_20tpp", "xs_47tpp", "s_20tpp"]))
        return 0
    if args.iiad:
        print("\n\n".join(iiad_share(cell) for cell in args.cells or committed))
        return 0
    if args.train_vs_heldout:
        print("\n\n".join(train_against_heldout(cell) for cell in args.cells or committed))
        return 0
    if args.compare:
        if len(args.cells) != 2:
            parser.exit(2, "error: --compare takes two cells, CELL_A CELL_B\n")
        print(compare(*args.cells))
        return 0
    H = entropy()
    print(f"Unigram entropy of the training tokens: {H:.3f} nats (the plateau: within 0.1 of it)\n")
    for cell in args.cells or committed:
        print(report(cell, H) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
