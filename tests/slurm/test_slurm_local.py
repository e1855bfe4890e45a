"""The slurm/ scripts, submitted for real to a SLURM cluster (opt-in: never in CI).

Start a local two-node cluster first (as root; installs slurm-wlm + munge with apt):

    bash /work/shared/recipes/local-slurm-cluster.sh start /tmp/slurm-test
    export SLURM_CONF=/tmp/slurm-test/slurm.conf
    IIET_TEST_SLURM=1 .venv/bin/python -m pytest tests/slurm -v

Jobs run with the submitting user's files, so tmp_path must be visible to every node (it is on the
local cluster, whose two "nodes" are this machine).
"""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("sbatch") is None or os.environ.get("IIET_TEST_SLURM") != "1",
    reason="opt-in SLURM test: needs `sbatch` on PATH, a running cluster (SLURM_CONF) and "
           "IIET_TEST_SLURM=1; see the module docstring",
)

CPU_JOB = ["-N", "2", "--ntasks-per-node=1", "--gres=none", "--cpus-per-task=1"]


def _run(cmd, **kw):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=kw.pop("timeout", 60),
                          **kw)


@pytest.fixture(scope="module")
def cluster():
    proc = _run(["sinfo", "-h", "-o", "%D %T"])
    assert proc.returncode == 0, f"sinfo failed (is the cluster running, SLURM_CONF set?): {proc.stderr}"
    nodes = sum(int(line.split()[0]) for line in proc.stdout.splitlines() if line.strip())
    assert nodes >= 2, f"need 2 nodes, sinfo says: {proc.stdout}"


@pytest.fixture(scope="module")
def dataset(cluster, tmp_path_factory):
    """A tokenizer, and a small dataset made by slurm/preprocess.sbatch."""
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    root = tmp_path_factory.mktemp("slurm_data")
    tok = prepare_builtin_corpus(str(root / "builtin"), vocab_size=512,
                                 corpus_size="256KB").tokenizer_model
    out = root / "preprocess-%j.out"
    proc = _run(["sbatch", "--wait", "--cpus-per-task=1", f"--output={out}",
                 "slurm/preprocess.sbatch", "--input", "builtin:python-stdlib:512KB",
                 "--tokenizer", tok, "--output-prefix", str(root / "data" / "stdlib")],
                timeout=600)
    logs = "".join(p.read_text() for p in root.glob("preprocess-*.out"))
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{logs}"
    assert (root / "data" / "stdlib.bin").is_file(), logs
    return {"tokenizer": tok, "prefix": str(root / "data" / "stdlib")}


def _train_args(dataset, log_dir, steps, *extra):
    sets = {"schedule.train_steps": steps, "schedule.warmup_steps": 1,
            "data.train": dataset["prefix"], "data.tokenizer": dataset["tokenizer"],
            "data.split": "70,30,0", "data.num_workers": 0, "logging.dir": str(log_dir),
            "logging.progress_bar": "false", "logging.tensorboard": "false",
            "logging.log_interval": 1, "eval.steps": 2, "checkpoint.save_interval": 0}
    args = ["slurm/pretrain.sbatch", "examples/tiny_iiet.yaml"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return args + list(extra)


def _records(log_dir, kind):
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def _job_field(job, field):
    out = _run(["scontrol", "show", "job", job]).stdout
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else None


def test_two_node_job_trains_and_checkpoints(dataset, tmp_path):
    log_dir = tmp_path / "run"
    out = tmp_path / "train-%j.out"
    proc = _run(["sbatch", "--wait", *CPU_JOB, f"--output={out}",
                 *_train_args(dataset, log_dir, 4)], timeout=900)
    log = "".join(p.read_text() for p in tmp_path.glob("train-*.out"))
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{log[-4000:]}"
    # one rank per node
    assert re.search(r"launch: rank 0/2 \(local 0\) on node node1", log), log[-4000:]
    assert re.search(r"launch: rank 1/2 \(local 0\) on node node2", log), log[-4000:]
    assert "done: 4 steps" in log
    ckpt = log_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"
    meta = json.loads((ckpt / "iter_0000004" / "meta.json").read_text())
    assert meta["layout"] == {"tensor": 1, "pipeline": 1, "data": 2}
    assert sorted(p.name for p in (ckpt / "iter_0000004" / "rng").iterdir()) == [
        "rank0.pt", "rank1.pt"]
    assert [r["step"] for r in _records(log_dir, "train")] == [1, 2, 3, 4]
    assert _records(log_dir, "end")[-1]["finished"] is True


def test_usr1_saves_requeues_and_resumes(dataset, tmp_path):
    """The time-limit warning (USR1 to the batch script, as --signal=B:USR1@120 sends it): the
    ranks save and exit 0, the script requeues the job, and the requeued job resumes."""
    log_dir = tmp_path / "run"
    out = tmp_path / "train-%j.out"
    proc = _run(["sbatch", "--parsable", *CPU_JOB, f"--output={out}",
                 *_train_args(dataset, log_dir, 40)])
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 300
        while not any(r["step"] >= 2 for r in _records(log_dir, "train")):
            assert time.time() < deadline, "the job did not start training within 300 s"
            time.sleep(1)
        assert _run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
        # SLURM holds a requeued job back for a while (~2 min here) before it starts again
        deadline = time.time() + 900
        while _job_field(job, "JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            assert time.time() < deadline, f"job {job} still {_job_field(job, 'JobState')}"
            time.sleep(3)
        log = out.with_name(f"train-{job}.out").read_text()
        assert _job_field(job, "JobState") == "COMPLETED", log[-4000:]
    finally:
        _run(["scancel", job])
    assert _job_field(job, "Restarts") == "1", log[-4000:]
    ends = _records(log_dir, "end")
    assert [e["preempted"] for e in ends] == [True, False], ends
    stopped = ends[0]["step"]
    assert 2 <= stopped < 40 and ends[1]["finished"] is True
    assert [r["step"] for r in _records(log_dir, "resume")] == [stopped]
    assert "requeueing job" in log and "resumed from" in log
    steps = [r["step"] for r in _records(log_dir, "train")]
    assert steps == list(range(1, 41)), steps  # nothing repeated, nothing skipped
