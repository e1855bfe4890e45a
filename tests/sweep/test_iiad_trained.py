"""examples/iiad_trained.py (issue 31.5) on a tiny one-run sweep: the influence of the IIET run's
checkpoint at 3/4 of its steps, the 2x-decode plan, and the pruned student trained from there to
the run's last step, distilled from the finished IIET, with the run's step, schedule and data."""

import json
import subprocess
import sys

from tests.sweep.conftest import ENV, REPO, launch_iiet_cell

STEPS = 64


def test_the_2x_plan_student_continues_the_iiet_run_from_three_quarters(tmp_path, tiny_data):
    sweep, iiet_run = launch_iiet_cell(tmp_path, tiny_data, STEPS, 3, **{
        "eval.interval": 16, "logging.log_interval": 4, "checkpoint.keep_last": 5})

    script = [sys.executable, str(REPO / "examples" / "iiad_trained.py"), str(sweep),
              iiet_run.name, "--offset-tokens", "0"]
    proc = subprocess.run(script, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    work = tmp_path / "out" / "iiad" / iiet_run.name
    chosen = json.loads((work / "plan_x2.json").read_text())
    assert chosen["full_passes"] == 8 and chosen["passes"] <= 4  # 2 layers x (1 + 3 iterations)
    assert chosen["checkpoint"].endswith("iter_0000048")         # the run at 3/4
    student = tmp_path / "out" / "runs" / f"iiad_distil_x2_from_{iiet_run.name}"
    records = [json.loads(line) for line in (student / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[0]["step"] == 52 and train[-1]["step"] == STEPS  # from 48 on, logged every 4
    assert any(r["kind"] == "end" and r.get("finished") for r in records)
    assert any(r["kind"] == "distill" for r in records)  # the KL to the finished IIET
    # the run's own LR schedule, continued: the student's LR is the IIET run's at every step
    iiet_lr = {r["step"]: r["lr"] for r in map(json.loads, (iiet_run / "metrics.jsonl")
                                                 .read_text().splitlines()) if r["kind"] == "train"}
    assert all(abs(r["lr"] - iiet_lr[r["step"]]) < 1e-12 for r in train)
    from megatron_iiet.training.checkpoint_index import newest_complete, read_meta

    config = read_meta(newest_complete(student / "checkpoints")).config
    assert config["model"]["iterations"] == chosen["iterations"]
    assert config["distill"]["teachers"][0]["checkpoint"] == str(iiet_run / "checkpoints")

    again = subprocess.run(script + ["--dry-run"], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=300)  # the plan is there: the student's command
    assert again.returncode == 0 and "iiad_influence" not in again.stdout, again.stdout[-2000:]
    assert f"model.iterations={json.dumps(chosen['iterations'])}".replace(" ", "") in \
        again.stdout.replace(" ", ""), again.stdout[-2000:]

    collected = subprocess.run(script + ["--collect"], cwd=REPO, env=ENV, capture_output=True,
                               text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    summary = json.loads((tmp_path / "results" / "cell" / f"{student.name}.json").read_text())
    assert summary["plan"] == chosen["iterations"] and summary["iiet_run"] == iiet_run.name
    assert summary["switch_step"] == 48 and summary["valid_curve"][-1][0] == STEPS
    assert summary["valid_loss"] == [r for r in records if r["kind"] == "valid"][-1]["loss"]
    # on the training batches the summary keeps the cross entropy (a sweep run's train_curve)
    # and, beside it, the distillation objective, which adds the KL
    assert summary["train_curve"] == [[r["step"], r["lm"]] for r in train]
    assert summary["train_objective_curve"] == [[r["step"], r["loss"]] for r in train]
    assert all(r["loss"] > r["lm"] for r in train)
    # FLOPs: 3/4 of the IIET run's, then the pruned student's plus the teacher's forward
    from megatron_iiet.sweep.plan import plan_sweep

    full = plan_sweep(sweep, flops_per_second=1e9).runs[0].total_flops
    assert 0.75 * full < summary["flops"] < full and summary["teacher"] == iiet_run.name
