"""Distillation through pretrain_iiet.py (fresh processes, as users run it):

- an E-IIET student initialised from its IIET (``checkpoint.init_from``) with two live teachers
  (the IIET and a PCformer) logs CE and each KL apart inside the window and plain CE outside,
  and an interrupted run resumes bit-exactly (same losses, same final parameters);
- precomputed teacher logits: two ranks write the shards, a run killed mid-way and rerun writes
  byte-identical ones, and the student trains on them;
- the distilled checkpoint exports to HF with its per-layer iterations and the same logits;
- bad input fails before the first step with one line and exit 2: a teacher with another
  vocabulary, a plan whose length differs from the depth, logits of another dataset.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.forked import run_script
import torch

from tests.training.conftest import REPO, base_overrides, check_ok, launch, records

pytestmark = pytest.mark.distributed

PLAN = [1, 0, 2, 1]
STEPS = 6


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """A tiny IIET (r=2) and a PCformer, each trained a few steps on the same data."""
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    root = tmp_path_factory.mktemp("distill")
    data = prepare_builtin_corpus(str(root / "data"), vocab_size=512, corpus_size="256KB")
    runs = {}
    for name, arch in (("iiet", {"model.architecture": "iiet", "model.max_iterations": 2}),
                       ("pcformer", {"model.architecture": "pcformer_rk2"})):
        check_ok(launch(base_overrides(data, root / name, **arch, **{"schedule.train_steps": 4})))
        runs[name] = root / name / "checkpoints"
    return root, data, runs


def student_overrides(teachers, log_dir, distill: dict, **extra) -> list[str]:
    root, data, runs = teachers
    values = {"model.architecture": "iiet", "model.max_iterations": 2, "model.iterations": PLAN,
              "checkpoint.init_from": str(runs["iiet"]), "schedule.train_steps": STEPS,
              "distill": distill, **extra}
    return base_overrides(data, log_dir, **values)


def two_teachers(runs) -> dict:
    return {"teachers": [{"checkpoint": str(runs["iiet"]), "weight": 0.6},
                         {"checkpoint": str(runs["pcformer"]), "weight": 0.4}],
            "start_step": 2, "end_step": 5, "temperature": 1.5}


def _end_digest(log_dir) -> str:
    return records(log_dir, "end")[-1]["params_sha256"]


@pytest.fixture(scope="module")
def distilled(teachers, tmp_path_factory):
    """The student distilled from both teachers, uninterrupted."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    proc = launch(student_overrides(teachers, whole, two_teachers(teachers[2])))
    check_ok(proc)
    return whole, proc


def test_two_live_teachers_window_terms_and_bit_exact_resume(teachers, distilled, tmp_path):
    _, _, runs = teachers
    whole, proc = distilled
    assert "checkpoint.init_from: starting from the weights of" in proc.stdout
    steps = {r["step"]: r for r in records(whole, "train")}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, r in steps.items():
        inside = 2 < step <= 5
        assert ("kl_iiet" in r) == inside and ("kl_pcformer_rk2" in r) == inside, step
        if inside:
            total = r["lm"] + 0.6 * r["kl_iiet"] + 0.4 * r["kl_pcformer_rk2"]
            assert r["loss"] == pytest.approx(total, rel=1e-6)
            assert r["kl_iiet"] > 0 and r["kl_pcformer_rk2"] > 0
    cost = records(whole, "distill")
    assert cost and all(c["teacher_seconds"] > 0 and c["teacher_params_mb"] > 0 for c in cost)

    # the same run, stopped after step 3 (inside the window) and resumed
    split = tmp_path / "split"
    check_ok(launch(student_overrides(teachers, split, two_teachers(runs),
                                      **{"schedule.exit_interval": 3})))
    proc = launch(student_overrides(teachers, split, two_teachers(runs)))
    check_ok(proc)
    assert "resumed from" in proc.stdout and "init_from" not in proc.stdout
    resumed = {r["step"]: r for r in records(split, "train")}
    for step in range(1, STEPS + 1):
        for key in ("loss", "lm", "kl_iiet", "kl_pcformer_rk2"):
            assert resumed[step].get(key) == steps[step].get(key), (step, key)
    assert _end_digest(split) == _end_digest(whole)


def test_distilled_student_exports_to_hf_with_its_iterations(distilled, tmp_path):
    log_dir = distilled[0]
    folder = tmp_path / "hf"
    proc = run_script(REPO / "tools" / "convert_checkpoint.py",
                      ["megatron-to-hf", log_dir / "checkpoints", folder], cwd=REPO, timeout=600,
                      env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((folder / "config.json").read_text())
    assert config["iterations"] == PLAN

    from transformers import AutoModelForCausalLM

    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.hf.megatron_model import one_process_group

    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad(), one_process_group():
        native = load_for_inference(log_dir / "checkpoints", with_tokenizer=False)
        assert list(native.model.config.layer_iterations) == PLAN
        b = native.model(ids)
        a = hf(ids).logits
        b = b[..., :a.shape[-1]]
    assert (a - b).abs().max().item() < 1e-4


def _precompute(config: Path, runs, out: Path, nproc: int = 2, wait: bool = True, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(REPO / "tools" / "precompute_teacher_logits.py"),
           "--config", str(config), "--checkpoint", str(runs["iiet"]), "--output", str(out),
           "--top-k", "16", "--shard-samples", "2", "--batch-size", "1", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _as_config(overrides: list[str], path: Path) -> Path:
    """The student's overrides as a YAML file (the precompute tool reads the run's config)."""
    import yaml

    tree: dict = {}
    for text in overrides:
        key, raw = text.split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(raw)
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture(scope="module")
def offline(teachers, tmp_path_factory):
    _, _, runs = teachers
    root = tmp_path_factory.mktemp("offline")
    logits = root / "logits"
    distill = {"teachers": [{"logits": str(logits), "weight": 1.0}]}
    overrides = student_overrides(teachers, root / "student", distill,
                                  **{"schedule.train_steps": 12})
    config = _as_config(overrides, root / "student.yaml")
    proc = _precompute(config, runs, logits)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, logits, overrides


def test_precompute_killed_and_rerun_writes_identical_shards(teachers, offline, tmp_path):
    _, _, runs = teachers
    config, reference, _ = offline
    index = json.loads((reference / "index.json").read_text())
    assert index["num_samples"] == 12 * 4 and index["num_shards"] == 24
    out = tmp_path / "logits"
    proc = _precompute(config, runs, out, 2, False)
    deadline = time.time() + 300
    while not list(out.glob("shard_*.pt")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(list(out.glob("shard_*.pt")))
    assert 0 < written < index["num_shards"], written  # really killed mid-way
    rerun = _precompute(config, runs, out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for shard in sorted(reference.glob("shard_*.pt")):
        assert (out / shard.name).read_bytes() == shard.read_bytes(), shard.name
    assert sorted(p.name for p in out.glob("shard_*.pt")) == sorted(
        p.name for p in reference.glob("shard_*.pt"))


def test_student_trains_on_precomputed_logits(offline, tmp_path):
    _, _, overrides = offline
    log_dir = tmp_path / "student"
    check_ok(launch([*overrides, f"logging.dir={log_dir}"]))
    steps = records(log_dir, "train")
    assert len(steps) == 12 and all(r["kl_iiet_topk"] > 0 for r in steps)


def _one_line_error(proc, words: str) -> None:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "step 1/" not in proc.stdout


def test_bad_input_is_one_line_before_the_first_step(teachers, offline, tmp_path):
    root, _, runs = teachers
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    # a teacher trained with another tokenizer (another vocabulary)
    other = prepare_builtin_corpus(str(root / "other_data"), vocab_size=384, corpus_size="256KB")
    check_ok(launch(base_overrides(other, root / "other", **{"schedule.train_steps": 3})))
    bad_teacher = {"teachers": [{"checkpoint": str(root / "other" / "checkpoints")}]}
    _one_line_error(launch(student_overrides(teachers, tmp_path / "a", bad_teacher)),
                    "another tokenizer")

    _one_line_error(launch(student_overrides(teachers, tmp_path / "b", two_teachers(runs),
                                             **{"model.iterations": [1, 0]})),
                    "iterations: needs one entry per layer")

    _, logits, overrides = offline
    _one_line_error(launch([*overrides, f"logging.dir={tmp_path / 'c'}", "seed=99"]),
                    "do not match this run's training data")
    assert not (tmp_path / "c" / "checkpoints").exists() or not any(
        (tmp_path / "c" / "checkpoints").iterdir())
