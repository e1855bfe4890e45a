"""The slurm/ scripts, submitted with sbatch to a real two-node SLURM cluster (conftest.py starts
one per pytest run; under CI=true these tests run, never skip).

- a 2-node DP=2 pretraining job gives the loss curve of a local `torchrun --nproc-per-node 2`;
- USR1 to the batch script (what --signal=B:USR1@120 sends before the time limit): the job saves,
  requeues itself, resumes and ends at the uninterrupted job's final loss;
- the teacher-logit array job (2 tasks) writes the shards of a single-process run, byte for byte,
  also when one task is stopped mid-way and requeued;
- a sweep of 3 runs as array jobs (`tools/sweep.py submit`) completes with 3 results, and a
  resubmission skips them;
- conversion and evaluation jobs write their outputs;
- a missing config or checkpoint fails the job in seconds with one `error:` line, leaving nothing.

The jobs see this machine's files (the cluster's two "nodes" are this machine), so tmp_path works
as the shared file system.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("IIET_SHARED_DATA", REPO.parent / "shared" / "data"))
ONE_PER_NODE = ["-N", "2", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1"]
ONE_TASK = ["-N", "1", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1"]
STEPS = 24
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _run(cmd, timeout=120, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV, **kw.pop("env", {})}, **kw)


def sbatch(*args, wait=True, timeout=600, env=None):
    """Submit; with wait, block until the job ends and set returncode to the job's exit code.
    (Not `sbatch --wait`: it polls at up to 10 s intervals, which adds up over a dozen jobs.)"""
    proc = _run(["sbatch", "--parsable", *map(str, args)], env=env or {})
    job = proc.stdout.strip().split(";")[0].splitlines()[0] if proc.stdout.strip() else ""
    if wait and proc.returncode == 0:
        wait_for_jobs(job, timeout=timeout)
        proc.returncode = job_exit_code(job)
    return proc, job


def job_exit_code(job: str) -> int:
    code = job_field(job, "ExitCode") or "1:0"
    return int(code.split(":")[0]) or (1 if job_field(job, "JobState") != "COMPLETED" else 0)


def _query(cmd, patience: float = 60):
    """A squeue/scontrol query, asked again while slurmctld does not answer (it times out on a
    loaded machine): an empty answer must mean "no such job", never "no reply"."""
    deadline = time.time() + patience
    while True:
        proc = _run(cmd)
        if proc.returncode == 0 or "Invalid job id" in proc.stderr or time.time() > deadline:
            return proc
        time.sleep(1)


def job_field(job: str, field: str):
    out = _query(["scontrol", "show", "job", job]).stdout
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else None


def wait_for_jobs(*jobs: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while _query(["squeue", "-h", "-j", ",".join(jobs)]).stdout.strip():
        assert time.time() < deadline, _run(["squeue", "-j", ",".join(jobs)]).stdout
        time.sleep(0.3)


def release_requeued(job: str, timeout: float = 300) -> None:
    """SLURM holds a requeued job back for two minutes (BeginTime) to let its nodes settle; a
    test has no reason to wait for that, so start it now once it is pending again."""
    deadline = time.time() + timeout
    while True:
        state, restarts = job_field(job, "JobState"), job_field(job, "Restarts")
        if restarts and int(restarts) >= 1 and state in ("PENDING", "RUNNING", "COMPLETED"):
            break
        assert time.time() < deadline, f"job {job} was not requeued: {state}, restarts {restarts}"
        time.sleep(0.5)
    if state != "PENDING":
        return
    # Not while the nodes still clean up after the killed run: a slurmd asked to start a job it
    # is still ending refuses it ("already killed") and the job fails.
    while "comp" in _run(["sinfo", "-h", "-o", "%t"]).stdout:
        assert time.time() < deadline, _run(["sinfo"]).stdout
        time.sleep(0.5)
    time.sleep(3)
    _run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


def records(log_dir: Path, kind: str) -> list[dict]:
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def log_of(folder: Path, pattern: str = "*.out") -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(pattern)))


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- shared jobs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(slurm_cluster, tmp_path_factory):
    """A tokenizer, and a small dataset made on the cluster by slurm/preprocess.sbatch."""
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    root = tmp_path_factory.mktemp("slurm_data")
    ENV["IIET_JOBS_ROOT"] = str(root / "jobs")  # the launcher's per-job folders, out of the repository
    tokenizer = prepare_builtin_corpus(str(root / "builtin"), vocab_size=512,
                                       corpus_size="256KB").tokenizer_model
    proc, _ = sbatch(*ONE_TASK, f"--output={root}/preprocess-%j.out", "slurm/preprocess.sbatch",
                     "--input", "builtin:python-stdlib:512KB", "--tokenizer", tokenizer,
                     "--output-prefix", root / "data" / "stdlib")
    assert proc.returncode == 0, f"{proc.stderr}\n{log_of(root)[-3000:]}"
    assert (root / "data" / "stdlib.bin").is_file(), log_of(root)[-3000:]
    return {"tokenizer": tokenizer, "prefix": str(root / "data" / "stdlib"), "root": root}


def tiny_config(dataset, folder: Path, **extra) -> Path:
    """The tiny IIET on the dataset, as a config file (the precompute tool reads a run's config)."""
    tree = yaml.safe_load((REPO / "examples" / "tiny_iiet.yaml").read_text())
    tree["data"].update({"train": dataset["prefix"], "tokenizer": dataset["tokenizer"],
                         "split": "80,20,0", "num_workers": 0, "seq_length": 32,
                         "cache_dir": str(dataset["root"] / "cache")})
    tree["schedule"].update({"train_steps": STEPS, "warmup_steps": 2})
    tree["parallel"].update({"micro_batch_size": 2, "global_batch_size": 4})
    tree["checkpoint"].update({"save_interval": 0})
    tree["logging"] = {"dir": str(folder / "run"), "log_interval": 1, "progress_bar": False,
                       "tensorboard": False}
    tree["eval"] = {"interval": STEPS, "steps": 2}
    for key, value in extra.items():
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def preempt_once(job: str, started, what: str) -> None:
    """Once `started()` is true, send the time-limit warning (USR1 to the batch script, as
    --signal=B:USR1@120 does), let the requeued job start at once, and wait for its end."""
    try:
        deadline = time.time() + 300
        while not started():
            assert time.time() < deadline, f"{what} did not get going within 300 s"
            state = job_field(job, "JobState")
            assert state in ("PENDING", "CONFIGURING", "RUNNING"), f"{what} ended: {state}"
            time.sleep(0.05)
        assert _run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
        release_requeued(job)
        wait_for_jobs(job.split("_")[0], timeout=600)
    finally:
        _run(["scancel", job])


@pytest.fixture(scope="module")
def local_started(dataset, tmp_path_factory):
    """The same config as the 2-node job, uninterrupted, under a local `torchrun
    --nproc-per-node 2`: started before the job is submitted, so it runs while SLURM schedules,
    requeues and releases (most of that job's time is waiting)."""
    folder = tmp_path_factory.mktemp("local")
    config = tiny_config(dataset, folder)
    with open(folder / "torchrun.log", "w") as log:  # a file: a pipe could fill and stall it
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", "pretrain_iiet.py", "--config", str(config)],
                                cwd=REPO, env={**os.environ, **ENV}, stdout=log,
                                stderr=subprocess.STDOUT)
    yield proc, folder
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def two_node_run(dataset, tmp_path_factory, local_started):
    """A 2-node pretraining job (one rank per node), stopped once by the time-limit warning after
    its second step, requeued and resumed to the end."""
    folder = tmp_path_factory.mktemp("two_node")
    config = tiny_config(dataset, folder)
    proc, job = sbatch(*ONE_PER_NODE, f"--output={folder}/train-%j.out", "slurm/pretrain.sbatch",
                       config, wait=False, env={"IIET_JOB_DIR": str(folder / "job")})
    assert proc.returncode == 0, proc.stderr
    preempt_once(job, lambda: any(r["step"] >= 2 for r in records(folder / "run", "train")),
                 "the pretraining job")
    return {"config": config, "run": folder / "run", "log": log_of(folder, "train-*.out"),
            "job": job, "folder": folder}


@pytest.fixture(scope="module")
def local_run(local_started):
    proc, folder = local_started
    proc.wait(timeout=600)
    assert proc.returncode == 0, (folder / "torchrun.log").read_text()[-3000:]
    return folder / "run"


def curve(log_dir: Path) -> dict[int, float]:
    """Training loss by step (a resumed run's later records win, as they are what it kept)."""
    return {r["step"]: r["loss"] for r in records(log_dir, "train")}


# ---- the tests -----------------------------------------------------------------------------

def test_two_node_pretraining_gives_the_local_torchrun_loss_curve(two_node_run, local_run):
    log = two_node_run["log"]
    assert re.search(r"launch: rank 0/2 \(local 0\) on node node1", log), log[-4000:]
    assert re.search(r"launch: rank 1/2 \(local 0\) on node node2", log), log[-4000:]
    assert "health: 2 ranks on node1,node2 agree on world size 2 (gloo" in log, log[-4000:]
    job_dir = two_node_run["folder"] / "job"
    assert json.loads((job_dir / "health.json").read_text())["world_size"] == 2
    assert "pretrain_iiet.py --config" in (job_dir / "commands.sh").read_text()
    assert len((job_dir / "starts.log").read_text().splitlines()) == 2  # the start and the requeue
    meta = json.loads((two_node_run["run"] / "checkpoints" / f"iter_{STEPS:07d}" / "meta.json").read_text())
    assert meta["layout"] == {"tensor": 1, "pipeline": 1, "data": 2}
    slurm_curve, local_curve = curve(two_node_run["run"]), curve(local_run)
    assert sorted(slurm_curve) == sorted(local_curve) == list(range(1, STEPS + 1))
    # same ranks, same data order, same gloo reductions, an exact resume: the same numbers
    assert [slurm_curve[s] for s in sorted(slurm_curve)] == pytest.approx(
        [local_curve[s] for s in sorted(local_curve)], rel=1e-6, abs=1e-6)


def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_loss(two_node_run, local_run):
    log = two_node_run["log"]
    job = two_node_run["job"]
    assert job_field(job, "JobState") == "COMPLETED", log[-4000:]
    assert job_field(job, "Restarts") == "1", log[-4000:]
    assert "got SIGUSR1" in log and "requeueing job" in log, log[-4000:]
    ends = records(two_node_run["run"], "end")
    assert [e["preempted"] for e in ends] == [True, False], ends
    assert 2 <= ends[0]["step"] < STEPS and ends[1]["finished"] is True, ends
    assert ends[1]["step"] == STEPS
    # resumed from the preemption's checkpoint: the uninterrupted run's final losses, exactly
    assert curve(two_node_run["run"])[STEPS] == curve(local_run)[STEPS]
    assert records(two_node_run["run"], "valid")[-1]["loss"] == records(local_run, "valid")[-1]["loss"]


def _precompute_args(two_node_run, out: Path, samples: int) -> list:
    return ["--config", two_node_run["config"], "--checkpoint", two_node_run["run"] / "checkpoints",
            "--output", out, "--top-k", "8", "--samples", samples, "--shard-samples", "2",
            "--batch-size", "2"]


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard_*.pt"))}


def test_teacher_logit_array_job_with_a_requeued_task_matches_one_process(two_node_run, tmp_path):
    samples = 96
    reference = tmp_path / "single"
    proc = _run([sys.executable, "tools/precompute_teacher_logits.py", "--no-progress",
                 *map(str, _precompute_args(two_node_run, reference, samples))], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _shards(reference)
    assert len(expected) == samples // 2

    # The array (2 tasks), task 0 stopped mid-way by the time-limit warning (which kills the tool:
    # at most its shard in flight is lost), requeued by its batch script and started again.
    resumed = tmp_path / "resumed"
    proc, job = sbatch("--array=0-1", *ONE_TASK, f"--output={tmp_path}/resumed-%A_%a.out",
                       "slurm/precompute.sbatch", *_precompute_args(two_node_run, resumed, samples),
                       wait=False)
    assert proc.returncode == 0, proc.stderr
    task0 = f"{job}_0"
    preempt_once(task0, lambda: len(list(resumed.glob("shard_*.pt"))) >= 2, "the precompute task")
    log = log_of(tmp_path, "resumed-*.out")
    assert job_field(task0, "Restarts") == "1", log[-3000:]
    assert "requeueing job" in log, log[-3000:]
    assert _shards(resumed) == expected, log[-3000:]
    assert json.loads((resumed / "index.json").read_text()) == json.loads((reference / "index.json").read_text())
    assert not [p for p in resumed.iterdir() if "tmp" in p.name]


def _sweep_file(dataset, folder: Path) -> Path:
    tree = {
        "name": "slurm3", "base": str(REPO / "examples" / "tiny_iiet.yaml"),
        "output": str(folder / "out"), "architectures": ["vanilla"],
        "set": {"data.train": dataset["prefix"], "data.tokenizer": dataset["tokenizer"],
                "data.num_workers": 0, "data.split": "80,20,0",
                "data.cache_dir": str(dataset["root"] / "cache"), "logging.progress_bar": False,
                "logging.tensorboard": False, "eval.steps": 1, "checkpoint.save_interval": 8},
        "sizes": [{"name": "xs", "num_layers": 2, "hidden_size": 32},
                  {"name": "s", "num_layers": 2, "hidden_size": 64}],
        "tokens": [8 * 4 * 32], "batch": {"global_batch_size": 4, "micro_batch_size": 4, "seq_length": 32},
        "shape_rules": {"head_dim": 16},
        "lr": {"grid": {"vanilla": [3e-3, 1e-4]}, "carry": "inverse_width"},
        "seeds": [1],
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _submit_sweep(sweep: Path) -> tuple[list[str], str]:
    proc = _run([sys.executable, "tools/sweep.py", "submit", str(sweep), "--", *ONE_TASK,
                 f"--output={sweep.parent}/sweep-%A_%a.out"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.findall(r"array job (\d+)", proc.stdout), proc.stdout


def test_sweep_array_jobs_complete_and_a_resubmission_skips_them(dataset, tmp_path):
    sweep = _sweep_file(dataset, tmp_path)
    jobs, said = _submit_sweep(sweep)
    assert len(jobs) == 2, said  # phase 1 (the LR grid: 2 runs), phase 2 (1 run)
    wait_for_jobs(*jobs, timeout=600)
    log = log_of(tmp_path, "sweep-*.out")
    for job in jobs:
        assert job_field(f"{job}_0", "JobState") == "COMPLETED", log[-4000:]
    proc = _run([sys.executable, "tools/sweep.py", "collect", str(sweep)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results) == 3 and all(r["status"] == "finished" for r in results), results
    assert "best grid LR: vanilla 0.003" in log

    # Resubmitted: every run has finished, so no array task is even allocated.
    again, said = _submit_sweep(sweep)
    assert again == [], said
    assert said.count("runs finished, nothing to submit") == 2, said


@pytest.mark.skipif(not (SHARED_DATA / "piqa").is_dir(), reason=f"no PIQA under {SHARED_DATA}")
def test_conversion_and_evaluation_jobs_write_their_outputs(two_node_run, tmp_path):
    checkpoint = two_node_run["run"] / "checkpoints"
    # both at once: the conversion on one node, the native backend on both (data-parallel)
    _, convert = sbatch(*ONE_TASK, f"--output={tmp_path}/convert-%j.out", "slurm/convert.sbatch",
                        "megatron-to-hf", checkpoint, tmp_path / "hf", wait=False)
    _, evaluate = sbatch(*ONE_PER_NODE, f"--output={tmp_path}/eval-%j.out", "slurm/evaluate.sbatch",
                         "--checkpoint", checkpoint, "--tasks", "piqa", "--limit", "6",
                         "--data-dir", SHARED_DATA, "--output", tmp_path / "eval", wait=False)
    wait_for_jobs(convert, evaluate, timeout=600)
    assert job_exit_code(convert) == 0, log_of(tmp_path, "convert-*.out")[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and list((tmp_path / "hf").glob("*.safetensors"))
    assert job_exit_code(evaluate) == 0, log_of(tmp_path, "eval-*.out")[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert 0.0 <= results["results"]["piqa"]["acc,none"] <= 1.0
    assert (tmp_path / "eval" / "results.md").is_file()


def test_a_missing_config_or_checkpoint_fails_fast_with_one_line(two_node_run, tmp_path):
    cases = {
        "config": ["slurm/pretrain.sbatch", tmp_path / "nope.yaml"],
        "init_from": ["slurm/pretrain.sbatch", two_node_run["config"], "--set",
                      f"checkpoint.init_from={tmp_path / 'no_ckpt'}", "--set",
                      f"logging.dir={tmp_path / 'run'}"],
        "convert": ["slurm/convert.sbatch", "megatron-to-hf", tmp_path / "no_ckpt", tmp_path / "hf"],
        "precompute": ["slurm/precompute.sbatch", "--config", two_node_run["config"],
                       "--checkpoint", tmp_path / "no_ckpt", "--output", tmp_path / "logits"],
    }
    started = time.time()
    jobs = {name: sbatch(*ONE_TASK, f"--output={tmp_path}/{name}-%j.out", *args, wait=False)[1]
            for name, args in cases.items()}  # all at once: the nodes oversubscribe
    wait_for_jobs(*jobs.values(), timeout=120)
    assert time.time() - started < 60, time.time() - started
    for name, job in jobs.items():
        log = log_of(tmp_path, f"{name}-*.out")
        assert job_exit_code(job) != 0, (name, log)
        assert job_field(job, "JobState") == "FAILED", (name, log)
        errors = error_lines(log)
        assert len(errors) == 1 and ("nope.yaml" in errors[0] or "no_ckpt" in errors[0]), (name, log)
        assert "Traceback" not in log, (name, log)
    # nothing half-written: no run folder, no export, no logits
    assert not any((tmp_path / p).exists() for p in ("run", "hf", "logits"))
