"""SIGTERM finishes the step, saves and exits 0; an interrupted save never breaks `latest`; a
validation or task evaluation under way is cut short for the save."""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses
from tests.training.faults import wait_for


def _latest(log_dir) -> str:
    return (Path(log_dir) / "checkpoints" / "latest").read_text().strip()


def test_sigterm_during_training_saves_and_resumes(tiny_data, tmp_path):
    log = tmp_path / "run"
    long_run = {"schedule.train_steps": 400, "checkpoint.save_interval": 0}
    proc = launch(base_overrides(tiny_data, log, **long_run), wait=False)
    wait_for(lambda: len(records(log, "train")) >= 3, proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    stopped = records(log, "preempted")[0]["step"]
    assert _latest(log) == f"iter_{stopped:07d}"
    assert max(train_losses(log)) == stopped

    check_ok(launch(base_overrides(tiny_data, log, **{"schedule.train_steps": stopped + 2}),
                    nproc=1))
    assert records(log, "resume")[-1]["step"] == stopped
    assert max(train_losses(log)) == stopped + 2


def test_interrupted_saves_keep_a_valid_latest(tiny_data, tmp_path):
    log = tmp_path / "run"
    marker = tmp_path / "saving"
    settings = {"schedule.train_steps": 6, "checkpoint.save_interval": 2}
    paused = [str(Path(__file__).with_name("pause_in_save.py")), str(marker), "8"]

    # SIGKILL while the step-2 checkpoint is half written: nothing valid yet, no `latest`.
    proc = launch(base_overrides(tiny_data, log, **settings), entry=paused, wait=False)
    wait_for(marker.exists, proc=proc)
    os.killpg(proc.pid, signal.SIGKILL)  # like a node failure: the job and its helpers die
    proc.communicate(timeout=60)
    assert not (log / "checkpoints" / "latest").exists()
    assert list((log / "checkpoints").glob("*.partial"))

    # SIGTERM during the step-2 save: the save completes, the job stops cleanly after the next
    # step with its checkpoint, and `latest` points at it.
    marker.unlink()
    proc = launch(base_overrides(tiny_data, log, **settings), entry=paused, wait=False)
    wait_for(marker.exists, proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert not list((log / "checkpoints").glob("*.partial")), "stale partial save not removed"
    stopped = records(log, "preempted")[-1]["step"]
    assert _latest(log) == f"iter_{stopped:07d}"

    # Resume from it to the end (no pausing now).
    check_ok(launch(base_overrides(tiny_data, log, **settings), nproc=1))
    assert records(log, "resume")[-1]["step"] == stopped
    assert records(log, "end")[-1]["step"] == 6


def _sigterm_once_step_3_is_logged(proc, log) -> tuple[float, str]:
    """SIGTERM a while after step 3's training record, when its evaluation has begun; returns
    the seconds the run took to exit after it, and its output."""
    wait_for(lambda: any(r["step"] == 3 for r in records(log, "train")), proc=proc)
    time.sleep(3)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return time.time() - sent, out


def _resumes_from_step_3(tiny_data, log) -> None:
    check_ok(launch(base_overrides(tiny_data, log, **{"schedule.train_steps": 6}), nproc=1))
    assert records(log, "resume")[-1]["step"] == 3
    assert records(log, "end")[-1]["step"] == 6


def test_sigterm_during_a_long_validation_cuts_it_short_and_saves_at_once(tiny_data, tmp_path):
    log = tmp_path / "run"
    # 20000 validation batches take minutes here, far past torchrun's 30 s grace period.
    long_validation = {"schedule.train_steps": 6, "eval.interval": 3, "eval.steps": 20000}
    proc = launch(base_overrides(tiny_data, log, **long_validation), wait=False)
    seconds, out = _sigterm_once_step_3_is_logged(proc, log)
    assert "validation at step 3 cut short by a preemption" in out, out[-3000:]
    assert not records(log, "valid"), "the validation ran to its end"
    assert [r["step"] for r in records(log, "preempted")] == [3]
    assert _latest(log) == "iter_0000003"
    assert seconds < 60, f"took {seconds:.0f}s to save and exit"
    _resumes_from_step_3(tiny_data, log)


def test_sigterm_during_task_evaluation_cuts_it_short_and_saves_at_once(tiny_data, tmp_path):
    from tests.eval.conftest import require_task_data

    require_task_data()
    log = tmp_path / "run"
    # Every example of two tasks, one per batch: minutes of scoring.
    long_tasks = {"schedule.train_steps": 6, "eval.tasks": "[lambada_openai,piqa]",
                  "eval.tasks_interval": 3, "eval.tasks_limit": None,
                  "eval.tasks_batch_size": 1}
    proc = launch(base_overrides(tiny_data, log, **long_tasks), wait=False)
    seconds, out = _sigterm_once_step_3_is_logged(proc, log)
    preempted = records(log, "preempted")
    assert [r["step"] for r in preempted] == [3], out[-3000:]
    assert "task evaluation" in preempted[0]["cut_short"]
    assert not records(log, "tasks"), "the task evaluation ran to its end"
    assert _latest(log) == "iter_0000003"  # saved although the stop came after step 3's save
    assert seconds < 60, f"took {seconds:.0f}s to save and exit"
    _resumes_from_step_3(tiny_data, log)
