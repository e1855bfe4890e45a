"""Shared fixtures: a small tokenizer + dataset from the built-in corpus, and a launcher that runs
pretrain_iiet.py in fresh processes (torchrun for several ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import run_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    root = tmp_path_factory.mktemp("builtin_data")
    return prepare_builtin_corpus(str(root), vocab_size=512, corpus_size="512KB")


def base_overrides(data, log_dir, **extra) -> list[str]:
    values = {
        "model.preset": "tiny",
        "data.train": data.data_prefix,
        "data.tokenizer": data.tokenizer_model,
        "data.seq_length": 32,
        "data.num_workers": 0,
        "data.cache_dir": str(Path(log_dir).parent / "data_cache"),
        "optimizer.lr": 3e-3,
        "optimizer.min_lr": 3e-4,
        "schedule.train_steps": 6,
        "schedule.warmup_steps": 2,
        "parallel.micro_batch_size": 2,
        "parallel.global_batch_size": 4,
        "logging.dir": str(log_dir),
        "logging.progress_bar": False,
        "logging.tensorboard": False,
        "eval.steps": 2,
        "data.split": "80,20,0",
    }
    values.update(extra)
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]


def launch(overrides: list[str], nproc: int = 1, env: dict | None = None, wait: bool = True,
           timeout: float = 600, entry: list[str] | None = None):
    """Run pretrain_iiet.py (or ``entry``: a script and its first arguments) with ``overrides``."""
    args = list(entry or [str(REPO / "pretrain_iiet.py")])
    for o in overrides:
        args += ["--set", o]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "PYTHONWARNINGS": "ignore", **(env or {})}
    if not wait:
        # its own process group, so a test can kill the run with every helper it spawned
        return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if nproc == 1:  # forked from this process when it can be (tests/forked.py)
        return run_script(args[0], args[1:], cwd=REPO, env=full_env, timeout=timeout)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def check_ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def records(log_dir, kind: str) -> list[dict]:
    path = Path(log_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def train_losses(log_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(log_dir, "train")}
