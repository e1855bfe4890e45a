"""A restarted run's metrics.jsonl read back: the latest attempt's records replace the earlier
one's from the step it restarted at, in every reader (sweep collect, the variant scripts'
collect, tools/compare_runs.py), so curves run forward once."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_iiet.training.metrics_log import last_attempt, read_records

REPO = Path(__file__).resolve().parents[2]


def _restarted_log(path: Path) -> Path:
    """A run killed at step 175 before its first save, begun again from scratch (its second
    attempt starts worse: another data order), killed at step 550 after a save at 500 and
    resumed from it; the kill cut the last line of the second attempt."""
    lines = []

    def train(steps, offset):
        lines.extend(json.dumps({"kind": "train", "step": s, "loss": 8.0 - s / 100 + offset})
                     for s in steps)

    train(range(25, 176, 25), 0.5)                         # attempt 1
    train(range(25, 551, 25), 0.0)                         # attempt 2, from scratch
    lines.insert(len(lines) - 2, json.dumps({"kind": "valid", "step": 500, "loss": 3.2}))
    lines.append(json.dumps({"kind": "checkpoint", "step": 500}))
    lines.append('{"kind": "train", "st')                  # cut by the kill
    lines.append(json.dumps({"kind": "resume", "step": 500}))
    train(range(525, 751, 25), -0.25)                      # attempt 3, from the checkpoint
    lines.append(json.dumps({"kind": "valid", "step": 750, "loss": 2.9}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_latest_attempt_replaces_the_earlier_from_where_it_restarted(tmp_path):
    records = read_records(_restarted_log(tmp_path / "metrics.jsonl"))
    assert len(records) == 7 + 22 + 1 + 1 + 1 + 10 + 1  # the cut line alone is skipped
    train = last_attempt(records, "train")
    steps = [r["step"] for r in train]
    assert steps == list(range(25, 751, 25))  # forward once
    by_step = {r["step"]: r["loss"] for r in train}
    assert by_step[175] == 8.0 - 1.75            # the second attempt's, not the first's
    assert by_step[550] == 8.0 - 5.5 - 0.25      # the third's
    assert by_step[500] == 8.0 - 5.0             # before the third attempt restarted
    assert [(r["step"], r["loss"]) for r in last_attempt(records, "valid")] == [(500, 3.2),
                                                                                 (750, 2.9)]
    assert read_records(tmp_path / "absent") == []
    assert read_records(tmp_path) == records     # a run folder reads as its metrics.jsonl


def test_sweep_collect_gives_the_latest_attempts_curves(tmp_path):
    import yaml

    from megatron_iiet.sweep.plan import plan_sweep
    from megatron_iiet.sweep.runner import run_dir, run_result

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "t", "base": str(REPO / "examples" / "tiny_iiet.yaml"),
        "output": str(tmp_path / "sweep"), "architectures": ["vanilla"],
        "set": {"data.builtin_dir": str(tmp_path / "builtin"), "data.builtin_vocab_size": 512},
        "sizes": [{"name": "xs", "num_layers": 2, "hidden_size": 32}],
        "tokens": [750 * 4 * 32], "batch": {"global_batch_size": 4, "micro_batch_size": 4,
                                            "seq_length": 32},
        "shape_rules": {"head_dim": 16}, "lr": {"values": {"vanilla": 1e-3}}}))
    plan = plan_sweep(sweep, flops_per_second=1e9)
    (run,) = plan.runs
    run_dir(plan, run).mkdir(parents=True)
    _restarted_log(run_dir(plan, run) / "metrics.jsonl")
    result = run_result(plan, run)
    assert [s for s, _ in result["train_curve"]] == list(range(25, 751, 25))
    assert result["train_curve"][6] == (175, 8.0 - 1.75)
    assert [loss for _, loss in result["loss_curve"]] == [3.2, 2.9]
    assert result["valid_loss"] == 2.9 and result["train_loss"] == 8.0 - 7.5 - 0.25


def test_compare_runs_reads_the_latest_attempt(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = _restarted_log(run / "metrics.jsonl")
    # compare_runs refuses a malformed line rather than guess: the cut line is an operator's
    # to see, so drop it here to read the rest
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()
                            if line.endswith("}")))
    from megatron_iiet.commands.compare_runs import read_run, summarize

    parsed = read_run(str(run))
    assert list(parsed["train"]) == list(range(25, 751, 25))
    assert parsed["train"][175]["loss"] == 8.0 - 1.75
    row = summarize(parsed, tail=1)
    assert row["steps"] == 750 and row["valid_loss"] == 2.9 and row["valid_step"] == 750
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "compare_runs.py"), str(run)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2.9000" in proc.stdout and "| 750 " in proc.stdout, proc.stdout
