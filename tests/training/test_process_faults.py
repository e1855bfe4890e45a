"""Preemption through the launcher, a lost launcher, two runs in one directory (issue 9, cases
3, 4, 15). Faults are real signals to real process trees; after each, the run resumes with a
loss curve bit-identical to an uninterrupted one, or refuses with one line."""

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from megatron_iiet.locks import DIRECTORY_LOCK, LockHeld, directory_lock
from megatron_iiet.training.checkpoint_index import defect
from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses
from tests.training.faults import alive, children, one_line_error, wait_for, wait_for_steps

STEPS = 40
pytestmark = pytest.mark.distributed


def _preempted_then_resumed(tiny_data, run, reference, settings, nproc, send):
    """Start, ``send(proc)`` a fault after 3 steps, expect a clean save, resume to the end and
    compare with ``reference`` bit for bit."""
    proc = launch(base_overrides(tiny_data, run, **settings), nproc=nproc, wait=False)
    wait_for_steps(run, 3, proc)
    send(proc)
    out, _ = proc.communicate(timeout=240)
    # torchrun itself prints a traceback for the signal it got; no rank may
    assert 'pretrain_iiet.py", line' not in out, out[-4000:]
    stopped = records(run, "preempted")
    assert stopped, out[-4000:]
    step = stopped[-1]["step"]
    assert step < STEPS
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == f"iter_{step:07d}" and defect(run / "checkpoints" / latest) is None
    check_ok(launch(base_overrides(tiny_data, run, **settings), nproc=nproc))
    assert records(run, "resume")[-1]["step"] == step
    assert train_losses(run) == train_losses(reference)
    assert records(run, "end")[-1]["params_sha256"] == records(reference, "end")[-1]["params_sha256"]
    return proc, stopped[-1]


TORCHRUN = {"schedule.train_steps": STEPS, "data.num_workers": 2}


@pytest.fixture(scope="module")
def torchrun_reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("torchrun_reference") / "run"
    check_ok(launch(base_overrides(tiny_data, run, **TORCHRUN), nproc=2))
    return run


def test_sigterm_to_torchrun_saves_every_rank_and_resumes_exactly(
        tiny_data, torchrun_reference, tmp_path):
    # torchrun forwards SIGTERM to each rank's process group (data-loader workers included), one
    # rank after another: under load rank 0 may hear of it from rank 1 at the step's all-reduce
    # first, and its record then names the signal rank 1 received
    proc, stop = _preempted_then_resumed(tiny_data, tmp_path / "run", torchrun_reference,
                                         TORCHRUN, 2, lambda p: p.send_signal(signal.SIGTERM))
    assert stop["reason"] in ("SIGTERM received", "SIGTERM received by another rank")


SINGLE = {"schedule.train_steps": STEPS}


@pytest.fixture(scope="module")
def single_reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("single_reference") / "run"
    check_ok(launch(base_overrides(tiny_data, run, **SINGLE)))
    return run


@pytest.mark.parametrize("sig,workers,async_save", [
    (signal.SIGTERM, 0, False),
    (signal.SIGUSR1, 2, True),
])
def test_signal_to_the_whole_process_group_saves_and_resumes_exactly(
        tiny_data, single_reference, tmp_path, sig, workers, async_save):
    # what `scancel --signal` and SLURM preemption do: every process of the job gets it, the
    # trainer's data-loader workers and checkpoint writers too (a save every step keeps them busy)
    settings = {**SINGLE, "data.num_workers": workers, "checkpoint.async_save": async_save,
                "checkpoint.save_interval": 1, "checkpoint.keep_last": 2}
    _, stop = _preempted_then_resumed(tiny_data, tmp_path / "run", single_reference, settings,
                                      1, lambda p: os.killpg(p.pid, sig))
    assert stop["reason"] == f"{sig.name} received"


def test_ranks_save_and_stop_when_torchrun_is_killed(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(base_overrides(tiny_data, run, **{**TORCHRUN, "schedule.train_steps": 400}),
                  nproc=2, wait=False)
    wait_for_steps(run, 3, proc)
    ranks = children(proc.pid)
    assert len(ranks) == 2, ranks
    proc.kill()  # SIGKILL to the launcher alone: the ranks live in their own sessions
    proc.wait()
    wait_for(lambda: not any(alive(r) for r in ranks), timeout=120)
    stop = records(run, "preempted")[-1]  # rank 0's: it may have seen it first, or rank 1
    assert stop["reason"] in (f"the launcher (torchrun, pid {proc.pid}) is gone",
                              "the launcher is gone (seen by another rank)")
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == f"iter_{stop['step']:07d}" and defect(run / "checkpoints" / latest) is None


def test_second_run_in_the_same_directory_refuses_and_the_first_is_unharmed(tiny_data, tmp_path):
    run = tmp_path / "run"
    settings = {"schedule.train_steps": 400, "checkpoint.save_interval": 5}
    first = launch(base_overrides(tiny_data, run, **settings), wait=False)
    wait_for_steps(run, 3, first)
    second = launch(base_overrides(tiny_data, run, **settings))
    one_line_error(second, f"{run.resolve()} is in use by pretrain_iiet.py",
                   f"pid {first.pid} on host {socket.gethostname()}")
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out[-3000:]
    steps = [r["step"] for r in records(run, "train")]
    assert steps == list(range(1, len(steps) + 1)), "metrics of two runs interleaved"
    assert len(records(run, "end")) == 1
    assert not (run / DIRECTORY_LOCK).exists(), "the lock outlived its run"


def _lock_file(directory: Path, **holder) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DIRECTORY_LOCK).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "start_time": None,
         "since": "then", "purpose": "job A", **holder}))


def test_run_lock_replaces_stale_locks_and_refuses_live_ones(tmp_path):
    dead = tmp_path / "dead"  # a job killed with -9 on this host: its pid is gone
    _lock_file(dead, pid=2**22 + 12345)
    with directory_lock(dead, "job B") as lock:
        assert lock.replaced_stale["purpose"] == "job A"
        assert lock.holder()["pid"] == os.getpid()
    assert not (dead / DIRECTORY_LOCK).exists()

    reused = tmp_path / "reused"  # the pid lives, but it is another process (start time differs)
    _lock_file(reused, start_time="1")
    with directory_lock(reused, "job B") as lock:
        assert lock.replaced_stale is not None

    live = tmp_path / "live"  # a running job (this test's own process, as seen from outside)
    _lock_file(live)
    with pytest.raises(LockHeld, match=f"in use by job A \\(pid {os.getpid()} on host"):
        directory_lock(live, "job B").acquire()
    assert (live / DIRECTORY_LOCK).exists()

    elsewhere = tmp_path / "elsewhere"  # another host's job cannot be checked from here
    _lock_file(elsewhere, host="node-17", pid=1)
    with pytest.raises(LockHeld, match=f"on host node-17.*remove {elsewhere / DIRECTORY_LOCK}"):
        directory_lock(elsewhere, "job B").acquire()
