"""The plateau measure and equal-x comparison of training curves (sweep/curves.py)."""

import math

import numpy as np
import pytest

from megatron_iiet.sweep.curves import at_equal_x, plateau, unigram_entropy


def test_plateau_spans_the_steps_spent_at_the_unigram_entropy():
    H = 6.7
    curve = [(s, 8.3 - 0.05 * s) for s in range(0, 30, 1)]  # falls to the plateau by step ~30
    curve += [(s, H + 0.02 * math.sin(s)) for s in range(30, 200)]  # sits on it
    curve += [(s, H - 0.03 * (s - 199)) for s in range(200, 400)]  # leaves it
    found = plateau(curve, H, band=0.1, total_steps=400, window=1)
    assert found.entered == 30 and found.left == 203  # H - 0.1 crossed 4 steps after leaving
    assert found.steps == 173 and found.fraction == pytest.approx(173 / 400)
    stuck = plateau(curve[:200], H, band=0.1, total_steps=400, window=1)
    assert stuck.left is None and stuck.steps == 400 - 30
    assert plateau([(s, 8.0) for s in range(10)], H).entered is None


def test_smoothing_keeps_one_lucky_batch_from_ending_the_plateau():
    H = 6.7
    curve = [(s, H) for s in range(100)]
    curve[50] = (50, H - 0.5)  # one lucky batch
    assert plateau(curve, H, window=1).left == 50
    assert plateau(curve, H, window=8).left is None


def test_values_at_equal_tokens_interpolate_inside_each_curve_only():
    curves = {"a": [(0.0, 8.0), (10.0, 6.0)], "b": [(0.0, 8.0), (5.0, 7.0)]}
    assert at_equal_x(curves, 5.0) == {"a": 7.0, "b": 7.0}
    assert at_equal_x(curves, 8.0) == {"a": pytest.approx(6.4), "b": None}


def test_unigram_entropy_of_a_dataset(small_dataset):
    prefix, tokens = small_dataset
    counts = np.bincount(np.concatenate(tokens))
    p = counts[counts > 0] / counts.sum()
    assert unigram_entropy(prefix) == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)


@pytest.fixture
def small_dataset(tmp_path):
    from megatron_iiet.data.indexed_io import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=n).astype(np.int32) for n in (5, 300, 1, 2000)]
    writer = IndexedDatasetWriter(str(tmp_path / "d"), np.int32)
    writer.add_documents(np.concatenate(docs), np.array([len(d) for d in docs]))
    writer.finalize({})
    return str(tmp_path / "d"), docs


def test_the_reports_tail_gain_is_the_fall_from_60_percent_of_the_tokens_per_lr(tmp_path):
    """examples/trained_regime_report.py --tail-gain: the held-out loss at 60% of a run's tokens
    (interpolated) minus its final loss, averaged over the seeds at one (architecture, LR)."""
    import json

    report = _report_module()

    def run(arch, lr, seed, curve, status="finished"):
        return {"architecture": arch, "lr": lr, "seed": seed, "status": status,
                "loss_curve": curve}

    runs = [run("vanilla", 4e-3, 1, [(0, 6.0), (10, 5.0), (20, 4.0)]),    # 4.8 at 12: 0.8
            run("vanilla", 4e-3, 2, [(0, 6.0), (10, 5.0), (20, 4.4)]),    # 4.88 at 12: 0.48
            run("iiet", 2e-3, 1, [(0, 6.0), (5, 5.0), (10, 4.5)]),        # 4.9 at 6: 0.4
            run("vanilla", 1.6e-2, 1, [(0, 6.0), (10, 4.0)]),             # 4.8 at 6: 0.8
            run("iiet", None, 2, [(0, 6.0), (10, 1.0)]),                  # phase 2, LR unknown
            run("iiet", 4e-3, 1, [(0, 6.0), (10, 1.0)], status="partial")]
    (tmp_path / "cell").mkdir()
    (tmp_path / "cell" / "results.json").write_text(json.dumps(runs))
    rows = report.tail_gain(["cell"], results=tmp_path).splitlines()
    # one column per LR the cell ran (2e-3, 4e-3, 1.6e-2): none is dropped, none is empty
    assert "| cell | architecture | LR 0.002 | LR 0.004 | LR 0.016 |" in rows
    assert "| cell | vanilla |  | 0.640 (2) | 0.800 (1) |" in rows
    assert "| cell | iiet | 0.400 (1) |  |  |" in rows
    assert not any("pcformer_rk2" in row for row in rows)


def _run_with_curves(arch, seed, train, held, lr=1e-3):
    """A finished run of 100M tokens in 10 steps: training losses logged at steps 1..10,
    validations every 10M tokens."""
    return {"architecture": arch, "lr": lr, "seed": seed, "status": "finished",
            "grid": True, "valid_loss": held(100e6), "tokens": 100e6, "train_steps": 10,
            "train_curve": [[step, train(step)] for step in range(1, 11)],
            "loss_curve": [[m * 1e6, held(m * 1e6)] for m in range(10, 101, 10)]}


def test_the_reports_train_vs_heldout_pairs_seeds_on_the_same_token_windows(tmp_path):
    """trained_regime_report.py --train-vs-heldout: per window of tokens (from 20% of the run),
    IIET minus the baseline on the logged training batches (steps turned into tokens) and on the
    held-out validations inside the window, each averaged per seed, then over the seeds both
    ran; the last column is held-out minus training."""
    import json

    report = _report_module()
    run = _run_with_curves
    runs = [run("iiet", 1, lambda s: 4.0 - 0.01 * s, lambda t: 4.5),
            run("vanilla", 1, lambda s: 4.1, lambda t: 4.55),
            run("iiet", 2, lambda s: 4.0, lambda t: 4.5),
            run("vanilla", 2, lambda s: 4.235, lambda t: 4.6),
            run("vanilla", 3, lambda s: 9.0, lambda t: 9.0)]       # no IIET seed 3: not paired
    (tmp_path / "cell").mkdir()
    (tmp_path / "cell" / "results.json").write_text(json.dumps(runs))
    rows = [r for r in report.train_against_heldout("cell", results=tmp_path).splitlines()
            if r.startswith("| vanilla |")]
    assert [r.split(" | ")[1] for r in rows] == ["20.0M-40.0M", "40.0M-60.0M", "60.0M-80.0M",
                                                 "80.0M-100.0M"]
    # (20M, 40M]: steps 3 and 4, validations at 30M and 40M. Seed 1: training -0.13 and -0.14,
    # held-out -0.05; seed 2: -0.235 and -0.1. Held-out minus training: +0.085 and +0.135.
    assert rows[0] == ("| vanilla | 20.0M-40.0M | -0.185 (-0.135 / -0.235) | "
                       "-0.075 (-0.050 / -0.100) | +0.110 |")
    # (80M, 100M]: steps 9 and 10 for seed 1
    assert rows[3].startswith("| vanilla | 80.0M-100.0M | -0.215 (-0.195 / -0.235) |")


def test_the_reports_compare_pairs_two_cells_by_seed_at_each_best_lr_and_by_token_window(
        tmp_path):
    """trained_regime_report.py --compare A B: B minus A per architecture at each cell's own
    best LR, paired by seed (a seed only one cell ran is left out), then the same pairs by window
    of tokens on training batches and on held-out text, as --train-vs-heldout does."""
    import json

    report = _report_module()
    run = _run_with_curves
    ours = [run("vanilla", 1, lambda s: 4.0, lambda t: 4.5),
            run("vanilla", 2, lambda s: 4.1, lambda t: 4.6),
            run("vanilla", 1, lambda s: 5.0, lambda t: 5.0, lr=2e-3),   # not its best LR
            run("vanilla", 3, lambda s: 4.0, lambda t: 4.4)]            # no seed 3 in release
    release = [run("vanilla", 1, lambda s: 4.0 - 0.02 * s, lambda t: 4.5 + 2 * t / 1e9),
               run("vanilla", 2, lambda s: 4.07, lambda t: 4.61)]
    for cell, runs in (("ours", ours), ("release", release)):
        (tmp_path / cell).mkdir()
        (tmp_path / cell / "results.json").write_text(json.dumps(runs))
    lines = report.compare("ours", "release", results=tmp_path).splitlines()
    rows = [r for r in lines if r.startswith("| vanilla |")]
    # held-out at the end: seed 1 4.7 - 4.5, seed 2 4.61 - 4.6 (seed 3 unpaired)
    assert rows[0].startswith("| vanilla | 0.001 / 0.001 | 1: +0.200, 2: +0.010 | ")
    windows = rows[1:]
    assert [r.split(" | ")[1] for r in windows] == ["20.0M-40.0M", "40.0M-60.0M", "60.0M-80.0M",
                                                    "80.0M-100.0M"]
    # (20M, 40M]: steps 3 and 4, validations at 30M and 40M. Seed 1: training -0.06, -0.08;
    # held-out +0.06, +0.08. Seed 2: training -0.03, held-out +0.01.
    assert windows[0] == ("| vanilla | 20.0M-40.0M | -0.050 (-0.070 / -0.030) | "
                          "+0.040 (+0.070 / +0.010) | +0.090 |")


def test_the_report_refuses_a_cell_without_committed_results_in_one_line():
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trained_regime_report.py"
    proc = subprocess.run([sys.executable, str(path), "xs_99tpp"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: no committed results for xs_99tpp (cells: ") and \
        "xs_20tpp" in line, line


def test_the_reports_iiad_share_is_the_students_part_of_iiets_gain_over_vanilla(tmp_path):
    """trained_regime_report.py --iiad: (vanilla - student) / (vanilla - IIET), vanilla as the
    mean of its seeds at its best LR, each student against its own IIET run."""
    import json

    report = _report_module()

    def run(name, arch, lr, seed, loss, grid=True):
        return {"name": name, "architecture": arch, "lr": lr, "seed": seed, "grid": grid,
                "status": "finished", "valid_loss": loss}

    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "results.json").write_text(json.dumps([
        run("v2", "vanilla", 2e-3, 1234, 4.30), run("v4", "vanilla", 4e-3, 1234, 4.22),
        run("v4s1", "vanilla", 4e-3, 1, 4.24, grid=False), run("v8", "vanilla", 8e-3, 1234, 4.25),
        run("i2", "iiet", 2e-3, 1234, 4.13), run("i4", "iiet", 4e-3, 1234, 4.30)]))
    student = {"iiet_run": "i2", "plan": [1, 1], "passes": 4, "full_passes": 8,
               "teacher": "i2", "valid_loss": 4.16}
    (cell / "iiad_distil_x2_from_i2.json").write_text(json.dumps({**student, "name": "d"}))
    (cell / "iiad_plain_x2_from_i4.json").write_text(json.dumps(
        {**student, "name": "p", "iiet_run": "i4", "teacher": None, "valid_loss": 4.35}))
    rows = report.iiad_share("cell", results=tmp_path).splitlines()
    assert rows[0] == "### IIAD in cell: against vanilla 0.004, 4.230 ± 0.014 (2 seeds)"
    # vanilla 4.23, IIET 4.13: a gain of 0.10, of which the student (4.16) keeps 0.07
    assert "| d | [1, 1] (4 of 8) | i2 | 4.1600 | 4.1300 | +0.1000 | 70% |" in rows
    assert "| p | [1, 1] (4 of 8) | - | 4.3500 | 4.3000 | -0.0700 | - (IIET does not lead) |" \
        in rows


def test_the_reports_iiad_windows_pair_each_student_with_its_run_on_the_same_batches(tmp_path):
    """trained_regime_report.py --iiad, second table: over the student's steps (from its switch
    step to the end, in 3 windows), the student minus its IIET run on the training batches both
    saw and on the held-out validations at the same steps; a student collected with only its
    distillation objective on the training batches gets no rows."""
    import json

    report = _report_module()
    iiet = {**_run_with_curves("iiet", 1234, lambda s: 4.0 - 0.01 * s, lambda t: 4.5 - t / 1e9),
            "name": "i", "grid": True}
    vanilla = {**_run_with_curves("vanilla", 1234, lambda s: 4.1, lambda t: 4.6), "name": "v"}
    (tmp_path / "cell").mkdir()
    (tmp_path / "cell" / "results.json").write_text(json.dumps([iiet, vanilla]))
    # from step 4 of 10: training 0.2 above IIET at steps 5-6, 0.15 at 7-8, 0.05 at 9-10;
    # held-out 0.1 above at every step, then 0.3 at step 10 (the student's rise)
    student = {"iiet_run": "i", "plan": [0, 1], "passes": 3, "full_passes": 8, "teacher": None,
               "switch_step": 4, "train_steps": 10, "tokens": 100e6, "valid_loss": 4.5,
               "train_curve": [[s, 4.0 - 0.01 * s + {5: .2, 6: .2, 7: .15, 8: .15}.get(s, .05)]
                               for s in range(5, 11)],
               "valid_curve": [[s, 4.5 - s / 100 + (0.3 if s == 10 else 0.1)]
                               for s in range(5, 11)]}
    (tmp_path / "cell" / "iiad_plain_x2_from_i.json").write_text(json.dumps(
        {**student, "name": "p"}))
    objective_only = {k: v for k, v in student.items() if k != "train_curve"}
    (tmp_path / "cell" / "iiad_distil_x2_from_i.json").write_text(json.dumps(
        {**objective_only, "name": "d", "teacher": "i", "train_objective_curve": []}))
    rows = report.iiad_share("cell", results=tmp_path).splitlines()
    windows = [r for r in rows if r.startswith("| p | ") and "M-" in r]
    # windows of 20M tokens from 40M: steps 5-6, 7-8, 9-10
    assert windows == ["| p | 40.0M-60.0M | +0.200 (+0.200) | +0.100 (+0.100) | -0.100 |",
                       "| p | 60.0M-80.0M | +0.150 (+0.150) | +0.100 (+0.100) | -0.050 |",
                       "| p | 80.0M-100.0M | +0.050 (+0.050) | +0.200 (+0.200) | +0.150 |"]
    assert not any(r.startswith("| d | 40") for r in rows)


def test_the_reports_seed_tests_pair_only_the_seeds_both_architectures_ran():
    """seed_test_lines: Welch over every seed at each best LR; the paired test over the shared seeds,
    each difference taken within one seed (same data order), so a seed only one side ran is
    left out of the pairing; along the run the same pairing at the validations every paired seed
    reached."""

    from scipy.stats import ttest_rel

    report = _report_module()

    def run(arch, lr, seed, loss, grid=True, early=0.0):
        # validations at 1M, 2M and 3M tokens; `early` is added at 1M only
        curve = [[1e6, loss + 0.3 + early], [2e6, loss + 0.1], [3e6, loss]]
        return {"architecture": arch, "lr": lr, "seed": seed, "grid": grid, "valid_loss": loss,
                "loss_curve": curve}

    runs = [run("vanilla", 4e-3, 1234, 4.00), run("vanilla", 8e-3, 1234, 3.95),
            run("vanilla", 8e-3, 1, 3.98, grid=False), run("vanilla", 8e-3, 2, 3.97, grid=False),
            run("iiet", 4e-3, 1234, 3.93, early=0.2), run("iiet", 4e-3, 1, 3.97, grid=False),
            run("iiet", 4e-3, 7, 3.50, grid=False)]          # seed 7: iiet only, not paired
    welch, paired, heading, along = [line for line in report.seed_test_lines(runs) if line]
    assert welch.startswith("Welch's t-test at the best LRs: vanilla - iiet +0.167 ")
    expected = ttest_rel([3.95, 3.98], [3.93, 3.97])
    assert paired == ("Paired by seed at the best LRs: vanilla - iiet +0.010 / +0.020 (mean "
                      f"+0.015, t = {expected.statistic:.2f}, p = {expected.pvalue:.2f}, 2 seeds)")
    assert heading.startswith("Along the run, paired by seed")
    # at 1M tokens the per-seed differences are -0.180 and +0.010; at the end +0.020 and +0.010
    at_1m = ttest_rel([4.25, 4.28], [4.43, 4.27])
    assert along == (f"- vanilla - iiet: 1.0M -0.085 ± 0.134 (p = {at_1m.pvalue:.2f}); "
                     f"3.0M +0.015 ± 0.007 (p = {expected.pvalue:.2f})")
    assert report.best_lr(runs, "iiet") == (4e-3, "no: 1 grid LR, so the best is at an edge")
    # a cell that fixes an architecture's LR (lr.values: every run off the grid, one LR)
    fixed = [run("vanilla", 8e-3, seed, 3.9, grid=False) for seed in (1234, 1)]
    assert report.best_lr(fixed, "vanilla") == (8e-3, "no: a fixed LR, not tuned in this cell")


def test_the_reports_wikitext_curves_average_the_shared_checkpoints_and_pair_by_seed(tmp_path):
    """wikitext_curve_lines: each architecture at its best LR, the mean over its seeds with a curve
    at the token counts every curve has (a preemption's extra checkpoint is left out), and the gap
    to vanilla within each seed both ran; the PNG is drawn."""
    report = _report_module()

    def run(arch, lr, seed, loss, curve, grid=True):
        return {"architecture": arch, "lr": lr, "seed": seed, "grid": grid, "valid_loss": loss,
                "flops_per_token": 1.0, "loss_curve_wikitext": curve}

    runs = [run("vanilla", 4e-3, 1234, 4.0, None),                       # no checkpoints left
            run("vanilla", 2e-3, 1234, 4.1, None),
            run("vanilla", 4e-3, 1, 4.0, [(1e6, 6.5), (2e6, 6.1)], grid=False),
            run("vanilla", 4e-3, 2, 4.0, [(1e6, 6.7), (2e6, 6.3)], grid=False),
            run("iiet", 2e-3, 1234, 3.9, None),
            run("iiet", 2e-3, 1, 3.9, [(1e6, 6.6), (1.5e6, 6.2), (2e6, 6.0)], grid=False),
            run("iiet", 2e-3, 2, 3.9, [(1e6, 6.7), (2e6, 6.2)], grid=False)]
    lines = report.wikitext_curve_lines("c", runs, img=tmp_path)
    assert lines[3] == "| tokens | vanilla (seeds 1, 2) | iiet (seeds 1, 2) |"
    assert lines[5:] == ["| 1.00M | 6.600 | 6.650 (+0.050 ± 0.071) |",
                         "| 2.00M | 6.200 | 6.100 (-0.100 ± 0.000) |"]
    assert (tmp_path / "trained_c_wikitext.png").stat().st_size > 10_000
    assert report.wikitext_curve_lines("c", [r for r in runs if r["seed"] == 1234]) == []


def _report_module():
    """examples/trained_regime_report.py, which is a script, not a package module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trained_regime_report.py"
    spec = importlib.util.spec_from_file_location("trained_regime_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report
