"""A stopped rank (issue 28, item 18): SIGSTOP to one rank of a real 2-rank gloo job on CPU. It
used to hang the job for ever (megatron's groups kept their own 30-minute timeout, and nothing
watched step progress); now the stall watchdog ends the job with one line naming the rank, and
without it the collective timeout fires on megatron's groups too."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.training.conftest import base_overrides, launch
from tests.training.faults import alive, wait_for, wait_for_steps

pytestmark = pytest.mark.distributed


def _stop_rank_1(run, proc) -> int:
    """SIGSTOP rank 1 after a few steps; its pid from its heartbeat file, or torchrun's second
    child when the watchdog is off."""
    from tests.training.faults import children

    wait_for_steps(run, 3, proc)
    beat = run / "heartbeats" / "rank1.json"
    if (run / "heartbeats").is_dir():
        wait_for(beat.exists, proc=proc)
        pid = json.loads(beat.read_text())["pid"]
    else:
        ranks = sorted(children(proc.pid))
        assert len(ranks) == 2, ranks
        pid = next(p for p in ranks if b"LOCAL_RANK=1" in
                   open(f"/proc/{p}/environ", "rb").read().split(b"\0"))
    os.kill(pid, signal.SIGSTOP)
    return pid


def _ended_within(proc, seconds: float, stopped: int) -> str:
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the job still ran {seconds:.0f} s after rank 1 stopped:\n{out[-3000:]}")
    finally:
        if alive(stopped):
            os.kill(stopped, signal.SIGKILL)  # never leave a stopped process behind
    return out


def test_a_stopped_rank_ends_the_job_with_one_line_naming_it(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(base_overrides(tiny_data, run, **{"schedule.train_steps": 5000,
                                                    "parallel.stall_timeout_s": 8}),
                  nproc=2, wait=False)
    stopped = _stop_rank_1(run, proc)
    t0 = time.time()
    out = _ended_within(proc, 120, stopped)
    lines = [ln for ln in out.splitlines() if ln.startswith("error: training stalled")]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("error: training stalled: rank 1 sent no heartbeat"), lines[0]
    assert "(parallel.stall_timeout_s=8); ending the job" in lines[0], lines[0]
    assert proc.returncode != 0
    # the watchdog fires 8 s after the last step; the rest is torchrun's teardown on a busy machine
    assert time.time() - t0 < 90
    wait_for(lambda: not alive(stopped), timeout=30)  # killed: a stopped process honours SIGKILL only


def test_without_the_watchdog_the_collective_timeout_fires_on_megatrons_groups(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = launch(base_overrides(tiny_data, run, **{"schedule.train_steps": 5000,
                                                    "parallel.stall_timeout_s": 0,
                                                    "parallel.collective_timeout_s": 30}),
                  nproc=2, wait=False)
    stopped = _stop_rank_1(run, proc)
    # rank 0's data-parallel all-reduce times out after 30 s (the timeout also bounds the
    # rendezvous, so a few seconds would not survive the ranks' start on a busy machine)
    out = _ended_within(proc, 150, stopped)
    assert proc.returncode != 0
    assert "timed out" in out.lower() or "timeout" in out.lower(), out[-3000:]
