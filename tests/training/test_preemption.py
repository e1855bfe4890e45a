"""SIGTERM finishes the step, saves and exits 0; an interrupted save never breaks `latest`."""

import os
import signal
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
