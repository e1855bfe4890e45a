"""examples/release_distill.py (issue 31.3) on a tiny cell of a PCformer-RK2 and an IIET run:
IIET distilled from the finished PCformer on the release's window (2/3 to 5/6 of its steps), and
its control, branched from the distilled run before the window and trained on without the
teacher. On one machine the control is the cell's own IIET run, step for step: the pair differs
only by the distillation."""

import json
import subprocess
import sys

from tests.sweep.conftest import ENV, REPO, launch_cell

STEPS = 36  # window: 24 < step <= 30; the sweep saves every 9 steps, so the control starts at 18


def _records(folder, kind):
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


def _losses(folder):
    from megatron_iiet.training.metrics_log import last_attempt, read_records

    return {r["step"]: r["loss"] for r in last_attempt(read_records(folder), "train")}


def test_the_control_is_the_distilled_run_without_its_teacher(tmp_path, tiny_data):
    sweep, runs = launch_cell(tmp_path, tiny_data, STEPS, 2, ("pcformer_rk2", "iiet"), **{
        "eval.interval": 12, "logging.log_interval": 3, "checkpoint.keep_last": 5})
    script = [sys.executable, str(REPO / "examples" / "release_distill.py"), str(sweep),
              runs["pcformer_rk2"].name, "--lr", "3e-3", "--seed", "1234"]

    def run(*extra):
        proc = subprocess.run(script + list(extra), cwd=REPO, env=ENV, capture_output=True,
                              text=True, timeout=600)
        return proc.returncode, proc.stdout + proc.stderr

    rc, out = run("--control")
    assert rc == 2 and "no complete checkpoint at or before step 24" in out, out[-2000:]
    rc, out = run()
    assert rc == 0, out[-3000:]
    rc, out = run("--control")
    assert rc == 0 and "branched from" in out and out.rstrip().endswith("iter_0000018"), out[-3000:]

    distilled, control = (tmp_path / "out" / "runs" / f"release_{kind}_iiet_lr0.003_s1234_from_"
                          f"{runs['pcformer_rk2'].name}" for kind in ("distill", "control"))
    assert [r["step"] for r in _records(distilled, "distill")][0] == 25  # the window opens
    assert not _records(control, "distill")
    plain, taught, paired = _losses(runs["iiet"]), _losses(distilled), _losses(control)
    assert sorted(paired) == sorted(plain) == [1, *range(3, STEPS + 1, 3)]
    # before the window the distilled run is the plain run; the control is it all the way
    assert all(taught[s] == plain[s] for s in plain if s <= 24)
    assert paired == plain
    assert any(taught[s] != plain[s] for s in plain if s > 24)
    from megatron_iiet.training.checkpoint_index import newest_complete, read_meta

    config = read_meta(newest_complete(control / "checkpoints")).config
    assert not config["distill"]["teachers"] and config["logging"]["dir"] == str(control)

    rc, out = run("--control", "--collect")
    assert rc == 0, out[-2000:]
    summary = json.loads((tmp_path / "results" / "cell" / f"{control.name}.json").read_text())
    assert summary["branch_step"] == 18 and summary["control_of"] == distilled.name
    assert summary["window"] == [24, 30] and summary["valid_curve"][-1][0] == STEPS
    assert [s for s, _ in summary["valid_curve"]] == [12, 24, 36]  # 12 copied, 24 and 36 its own
    rc, out = run("--control", "--dry-run")
    assert rc == 0 and "distill." not in out and f"logging.dir={control}" in out, out[-2000:]
