"""`tools/sweep.py launch` then `collect` on a 3-run tiny ladder (an LR grid of two values at the
small size, the best carried to the larger one): killed in the middle of its second run and
launched again, it skips the finished run, resumes the unfinished one from its checkpoint, runs
the third with the grid's best LR and collects three results."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.forked import run_script

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _sweep(tmp_path, data) -> Path:
    tree = {
        "name": "t3", "base": str(REPO / "examples" / "tiny_iiet.yaml"),
        "output": str(tmp_path / "out"), "architectures": ["vanilla"],
        "set": {"data.train": data.data_prefix, "data.tokenizer": data.tokenizer_model,
                "data.num_workers": 0, "data.split": "80,20,0",
                "data.cache_dir": str(tmp_path / "cache"), "logging.progress_bar": False,
                "logging.tensorboard": False, "eval.steps": 1,
                "logging.log_interval": 5},  # 64 steps: the last train record is at step 60
        "sizes": [{"name": "xs", "num_layers": 2, "hidden_size": 32},
                  {"name": "s", "num_layers": 2, "hidden_size": 64}],
        "tokens": [64 * 4 * 32], "batch": {"global_batch_size": 4, "micro_batch_size": 4,
                                           "seq_length": 32},
        "shape_rules": {"head_dim": 16},
        "lr": {"grid": {"vanilla": [3e-3, 1e-4]}, "carry": "inverse_width"},
        "seeds": [1],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _cli(*args, wait=True):
    cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return run_script(cmd[1], cmd[2:], cwd=REPO, env=ENV, timeout=900)  # tests/forked.py


def _records(run_dir: Path) -> list[dict]:
    from megatron_iiet.training.metrics_log import read_records  # a line cut by a kill: skipped

    return read_records(run_dir)


def test_launch_kill_relaunch_collect(tmp_path, tiny_data):
    sweep = _sweep(tmp_path, tiny_data)
    runs = tmp_path / "out" / "runs"
    first, second = runs / "vanilla_xs_8.192K_lr0.003_s1", runs / "vanilla_xs_8.192K_lr0.0001_s1"
    proc = _cli("launch", sweep, wait=False)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        saved = [r for r in _records(second) if r.get("kind") == "checkpoint"]
        if saved:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(r.get("kind") == "end" and r.get("finished") for r in _records(first))
    assert not any(r.get("kind") == "end" for r in _records(second))  # killed mid-way
    # A SLURM submission now allocates array tasks to the unfinished runs only.
    submit = _cli("submit", sweep, "--dry-run")
    assert submit.returncode == 0, submit.stderr[-3000:]
    assert "--array=1 " in submit.stdout and "--array=0 " in submit.stdout, submit.stdout

    again = _cli("launch", sweep)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"skip {first.name} (finished)" in again.stdout
    assert f"resume {second.name}" in again.stdout
    assert "best grid LR: vanilla 0.003" in again.stdout
    assert any(r.get("kind") == "resume" for r in _records(second))
    # each finished run is reported with its result and the sweep's ETA
    done = [line for line in again.stdout.splitlines() if line.startswith("done ")]
    assert len(done) == 2 and "valid loss" in done[0] and "1 left, ETA" in done[0], done
    assert done[1].endswith("0 left"), done

    # An extra validation set (here the training data itself) at every checkpoint each run kept.
    collected = _cli("collect", sweep, "--extra-valid", f"again={tiny_data.data_prefix}")
    assert collected.returncode == 0, collected.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results) == 3 and all(r["status"] == "finished" for r in results)
    assert all(r["valid_loss"] is not None and r["loss_curve"] for r in results)
    assert all(r["steps_done"] == r["train_steps"] == 64 for r in results)  # not the last log
    from megatron_iiet.training.checkpoint_index import list_checkpoints, step_of

    for r in results:
        kept = [step_of(c) for c in list_checkpoints(runs / r["name"] / "checkpoints")]
        per_step = r["tokens"] / r["train_steps"]
        assert [t for t, _ in r["loss_curve_again"]] == [s * per_step for s in kept], r["name"]
        assert len(kept) >= 2 and kept[-1] == 64  # (tiny_iiet.yaml keeps the last two)
        assert r["valid_loss_again"] == r["loss_curve_again"][-1][1]
    best = next(r for r in results if r["lr"] == 3e-3 and r["size"] == "xs")
    assert best["loss_curve_again"][0][1] > best["valid_loss_again"]  # still learning at the end
    # three runs of one architecture cannot pin a law: said, and no empty residual plot
    fitted = _cli("fit", sweep, "--bootstrap", "2")
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "no scaling law could be fitted: vanilla: not enough runs" in fitted.stdout
    assert not (tmp_path / "out" / "residuals.png").exists()
    assert (tmp_path / "out" / "loss_vs_tokens.png").is_file()
    assert "| 8.192K |" in (tmp_path / "out" / "fit.md").read_text()  # not 0.0M
    carried = next(r for r in results if r["size"] == "s")
    assert abs(carried["lr"] - 3e-3 * 32 / 64) < 1e-12  # inverse-width carry of the best
    assert json.loads((tmp_path / "out" / "best_lr.json").read_text()) == {"vanilla": 3e-3}
    assert (tmp_path / "out" / "results.csv").read_text().count("\n") == 4

    third = _cli("launch", sweep)  # nothing left to do
    assert third.stdout.count("(finished)") == 3 and "start" not in third.stdout
    assert _cli("submit", sweep, "--dry-run").stdout.count("nothing to submit") == 2

    # The carried LR changes under a finished run (here the carry rule; a grown grid whose
    # best moved does the same): it is refused in one line, not skipped as if still right.
    tree = yaml.safe_load(sweep.read_text())
    tree["lr"]["carry"] = "constant"
    sweep.write_text(yaml.safe_dump(tree))
    stale = _cli("launch", sweep)
    assert stale.returncode == 2, stale.stdout[-2000:] + stale.stderr[-2000:]
    assert "trained with lr 0.0015 but the plan now gives 0.003" in stale.stderr, stale.stderr


def test_submit_array_indices_are_compact_ranges():
    from megatron_iiet.sweep.runner import _index_ranges

    assert _index_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _index_ranges([3]) == "3"


def test_usr1_to_the_launcher_stops_its_run_with_a_save_and_starts_no_other(tmp_path, tiny_data):
    """What a SLURM array task's batch script forwards before the time limit (slurm/sweep.sbatch):
    the launcher passes the signal to its run, which saves and stops, and starts no other run."""
    sweep = _sweep(tmp_path, tiny_data)
    runs = tmp_path / "out" / "runs"
    first = runs / "vanilla_xs_8.192K_lr0.003_s1"
    proc = _cli("launch", sweep, wait=False)
    deadline = time.time() + 600
    while not any(r.get("kind") == "train" for r in _records(first)):
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # the launcher alone, as SLURM's batch script sees it
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "stopped by SIGUSR1" in out, out[-3000:]
    ends = [r for r in _records(first) if r.get("kind") == "end"]
    assert len(ends) == 1 and ends[0]["preempted"] and not ends[0]["finished"], ends
    assert [p.name for p in runs.iterdir()] == [first.name]  # no other run started


def test_jobs_run_side_by_side_and_finish_every_run(tmp_path, tiny_data):
    """`launch --jobs 2`: the grid's two runs train at the same time (their step records
    interleave in time), then the carried run; all three finish and collect."""
    sweep = _sweep(tmp_path, tiny_data)
    done = _cli("launch", sweep, "--jobs", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = tmp_path / "out" / "runs"
    grid = [runs / "vanilla_xs_8.192K_lr0.003_s1", runs / "vanilla_xs_8.192K_lr0.0001_s1"]
    spans = []
    for run in grid:
        times = [r["time"] for r in _records(run) if r.get("kind") == "train"]
        assert any(r.get("kind") == "end" and r.get("finished") for r in _records(run))
        spans.append((min(times), max(times)))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # overlapping
    assert "best grid LR: vanilla 0.003" in done.stdout
    assert _cli("launch", sweep, "--jobs", "2").stdout.count("(finished)") == 3
    bad = _cli("launch", sweep, "--jobs", "0")
    assert bad.returncode == 2 and "--jobs 0" in bad.stderr, bad.stderr


def test_runs_end_with_a_launcher_killed_with_minus_9_and_the_next_launch_resumes(
        tmp_path, tiny_data):
    """issue 28: `kill -9` of the launcher left its run training unobserved. The run gets
    SIGTERM from the kernel (PR_SET_PDEATHSIG), saves its step and exits; a new launch resumes."""
    from tests.training.faults import alive, children

    sweep = _sweep(tmp_path, tiny_data)
    tree = yaml.safe_load(sweep.read_text())
    tree["tokens"] = [400 * 4 * 32]  # long enough to be killed mid-way
    sweep.write_text(yaml.safe_dump(tree))
    runs = tmp_path / "out" / "runs"
    proc = _cli("launch", sweep, "--phase", "1", "--task", "0", wait=False)
    deadline = time.time() + 600
    while not (runs.is_dir() and any(r.get("kind") == "train" for d in runs.iterdir()
                                     for r in _records(d))):
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    (run,) = runs.iterdir()
    (trainer,) = children(proc.pid)
    proc.kill()  # the launcher alone, as `kill -9 PID` does
    proc.wait()
    gone_by = time.time() + 60  # its step and a save of a tiny model, on a loaded machine
    while alive(trainer):
        assert time.time() < gone_by, "the run outlived its launcher"
        time.sleep(0.1)
    ends = [r for r in _records(run) if r.get("kind") == "end"]
    assert len(ends) == 1 and ends[0]["preempted"] and not ends[0]["finished"], ends
    again = _cli("launch", sweep, "--phase", "1", "--task", "0")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resume {run.name}" in again.stdout
    assert any(r.get("kind") == "resume" for r in _records(run))
    assert any(r.get("kind") == "end" and r.get("finished") for r in _records(run))


def test_plan_measure_times_the_smallest_run_and_estimates_from_it(tmp_path, tiny_data):
    sweep = _sweep(tmp_path, tiny_data)
    proc = _cli("plan", sweep, "--dry-run", "--measure")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    measured = next(line for line in proc.stdout.splitlines() if line.startswith("measured:"))
    overhead = float(measured.split("TFLOP at the smallest run, ")[1].split(" s")[0])
    assert 1 < overhead < 600, measured  # python, megatron and the data indices take seconds
    # every run's estimate includes that overhead: none is the few seconds a GEMM rate gives
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| vanilla_")]
    assert len(rows) == 3 and all(not row.rstrip(" |").endswith(" 0 s") for row in rows)
    assert not (tmp_path / "out" / "runs").exists()  # the measurement ran elsewhere


def test_a_sweep_continues_from_committed_results_where_its_run_folders_are_gone(
        tmp_path, tiny_data):
    """A later session on a new machine: outputs/ is gone, results.json was committed. The
    finished runs count as finished (skipped, their losses pick the best LR), the rest runs."""
    import shutil

    sweep = _sweep(tmp_path, tiny_data)
    tree = yaml.safe_load(sweep.read_text())
    tree["sizes"] = tree["sizes"][:1]  # the grid alone: two runs
    sweep.write_text(yaml.safe_dump(tree))
    assert _cli("launch", sweep).returncode == 0
    assert _cli("collect", sweep).returncode == 0
    committed = tmp_path / "committed.json"
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    committed.write_text(json.dumps(rows[:1]))  # one of the two runs was committed
    shutil.rmtree(tmp_path / "out")  # the new machine
    tree["committed"] = "committed.json"
    sweep.write_text(yaml.safe_dump(tree))
    again = _cli("launch", sweep)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"skip {rows[0]['name']} (finished)" in again.stdout
    assert f"start {rows[1]['name']}" in again.stdout
    collected = _cli("collect", sweep)
    assert collected.returncode == 0, collected.stderr[-2000:]
    results = {r["name"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    assert results[rows[0]["name"]]["valid_loss"] == rows[0]["valid_loss"]
    assert all(r["status"] == "finished" for r in results.values())
    # its checkpoints are wanted here (e.g. for IIAD): trained again, it reproduces the committed
    # loss; a run finished on this machine is not trained again
    rebuilt = _cli("launch", sweep, "--retrain-committed")
    assert rebuilt.returncode == 0, rebuilt.stdout[-2000:] + rebuilt.stderr[-2000:]
    assert f"start {rows[0]['name']}" in rebuilt.stdout
    assert f"skip {rows[1]['name']} (finished)" in rebuilt.stdout
    assert (tmp_path / "out" / "runs" / rows[0]["name"] / "checkpoints").is_dir()
    assert _cli("collect", sweep).returncode == 0
    again = {r["name"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())}
    assert again[rows[0]["name"]]["valid_loss"] == pytest.approx(rows[0]["valid_loss"], rel=1e-6)


def test_an_architectures_seeds_start_once_its_own_grid_has_finished(tmp_path, tiny_data):
    """Phase 2 per architecture: vanilla's seed at its best LR runs while PCformer's grid has not
    finished; PCformer's seed is refused with one line naming its unfinished grid run."""
    sweep = _sweep(tmp_path, tiny_data)
    tree = yaml.safe_load(sweep.read_text())
    tree.update(architectures=["vanilla", "pcformer_rk2"], sizes=tree["sizes"][:1],
                lr={"grid": {"vanilla": [3e-3], "pcformer_rk2": [3e-3]}},
                noise={"size": "xs", "seeds": [2]})
    sweep.write_text(yaml.safe_dump(tree))
    assert _cli("launch", sweep, "--phase", "1", "--task", "0").returncode == 0  # vanilla's grid
    early = _cli("launch", sweep, "--phase", "2", "--task", "1")
    assert early.returncode == 2, early.stdout[-2000:] + early.stderr[-2000:]
    assert "pcformer_rk2_xs_8.192K_lr0.003_s1: the LR grid run has not finished" in early.stderr
    seed = _cli("launch", sweep, "--phase", "2", "--task", "0")
    assert seed.returncode == 0, seed.stdout[-2000:] + seed.stderr[-2000:]
    assert "best grid LR: vanilla 0.003" in seed.stdout
    assert "start vanilla_xs_8.192K_lrbest_s2" in seed.stdout
    out = tmp_path / "out"
    assert json.loads((out / "lr_choice.json").read_text()) == {"vanilla": 0.003}
    assert _cli("collect", sweep).returncode == 0
    lrs = {r["name"]: (r["status"], r["lr"]) for r in json.loads((out / "results.json").read_text())}
    assert lrs["vanilla_xs_8.192K_lrbest_s2"] == ("finished", 0.003)
    assert lrs["pcformer_rk2_xs_8.192K_lrbest_s2"] == ("missing", None)
