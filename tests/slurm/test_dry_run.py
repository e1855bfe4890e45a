"""The slurm/ scripts' `--dry-run` and their argument checks, without a cluster: what each job
would run (the health check and srun per task, or one process), and one-line refusals."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def script(name: str, *args, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", f"slurm/{name}", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={**clean, "PYTHONWARNINGS": "ignore", "IIET_REPO": str(REPO), **(env or {})})


def test_dry_runs_print_the_commands_of_each_job(tmp_path):
    proc = script("pretrain.sbatch", "--dry-run", "examples/tiny_iiet.yaml", "--set", "schedule.train_steps=40")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("launch: job 0, 1 task(s)") and "backend=gloo" in lines[0]
    srun = [line for line in lines if line.startswith("srun --kill-on-bad-exit=1")]
    assert len(srun) == 2 and "megatron_iiet.slurm health" in srun[0]
    assert "pretrain_iiet.py --config examples/tiny_iiet.yaml --set schedule.train_steps=40" in srun[1]

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    proc = script("convert.sbatch", "--dry-run", "megatron-to-hf", ckpt, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "srun" not in proc.stdout  # one process
    assert f"tools/convert_checkpoint.py megatron-to-hf {ckpt} {tmp_path / 'hf'}" in proc.stdout

    proc = script("precompute.sbatch", "--dry-run", "--config", "examples/tiny_iiet.yaml",
                  "--checkpoint", ckpt, "--output", tmp_path / "logits",
                  env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "precompute_teacher_logits.py --no-progress" in proc.stdout and "--slice 1/4" in proc.stdout

    proc = script("evaluate.sbatch", "--dry-run", "--hf", ckpt, "--output", tmp_path / "eval")
    assert proc.returncode == 0 and "srun" not in proc.stdout, proc.stdout + proc.stderr
    proc = script("evaluate.sbatch", "--dry-run", "--checkpoint", ckpt, "--output", tmp_path / "eval")
    assert proc.returncode == 0 and "srun" in proc.stdout and "tools/evaluate.py" in proc.stdout

    proc = script("sweep.sbatch", "--dry-run", "examples/sweeps/tiny_test.yaml", "--phase", "2",
                  env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_NTASKS_PER_NODE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "tools/sweep.py launch examples/sweeps/tiny_test.yaml --phase 2 --task 1 --nproc 4" in proc.stdout


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    cases = [
        ("pretrain.sbatch", [tmp_path / "nope.yaml"], "does not exist"),
        ("pretrain.sbatch", ["examples/tiny_iiet.yaml", "--set", "model.no_such_key=1"], "no_such_key"),
        ("convert.sbatch", ["to-onnx", tmp_path, tmp_path / "x"], "megatron-to-hf or hf-to-megatron"),
        ("influence.sbatch", ["--checkpoint", tmp_path / "none", "--data", "x", "--output", "y"], "does not exist"),
        ("sweep.sbatch", ["examples/sweeps/tiny_test.yaml", "--phase", "1"], "--array"),
        ("launch.sh", ["pretrain_iiet.py", "--config", "x.yaml"], "not inside a SLURM allocation"),
    ]
    for name, args, reason in cases:
        proc = script(name, *args)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert len(errors) == 1 and reason in errors[0], (name, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_pre_check_reads_every_blend_form_as_training_does(tmp_path):
    """The paper recipes write data.train as a weighted blend in one string: the pre-check used
    to take it for one path (refusing present data); lists and data.valid went unchecked."""
    from types import SimpleNamespace

    from megatron_iiet.slurm import _missing_inputs

    for name in ("a", "b", "v"):
        for ext in (".bin", ".idx"):
            (tmp_path / (name + ext)).write_bytes(b"x")
    a, b, v, gone = (str(tmp_path / n) for n in ("a", "b", "v", "gone"))

    def missing(train, valid=None):
        data = SimpleNamespace(train=train, valid=valid, tokenizer=None)
        return _missing_inputs(SimpleNamespace(data=data, checkpoint=SimpleNamespace()))

    assert missing(f"0.7 {a}\n0.3 {b}", valid=v) == []          # the recipes' folded string
    assert missing(["0.7", a, "0.3", b]) == []                      # the list form
    assert missing(f"0.7 {a} 0.3 {gone}") == [f"data.train {gone} (no {gone}.bin / .idx)"]
    assert missing([a], valid=gone) == [f"data.valid {gone} (no {gone}.bin / .idx)"]
    assert missing(f"0.7 {a} 0.3") and "WEIGHT PREFIX" in missing(f"0.7 {a} 0.3")[0]


def test_the_docs_cpu_pretrain_command_passes_its_own_check():
    """docs/slurm.md's commands on the CPU example (its data is built in, so nothing is missing
    here), as written (backslash continuations joined, comments dropped), pass the pre-check of
    a --dry-run."""
    import re
    import shlex

    text = (REPO / "docs" / "slurm.md").read_text()
    commands = [re.sub(r"\s+#.*$", "", c) for c in re.sub(r"\\\n\s*", "", text).splitlines()
                if "slurm/pretrain.sbatch examples/tiny_iiet.yaml" in c]
    assert commands, "docs/slurm.md no longer shows the CPU pretrain.sbatch example"
    for command in commands:
        args = shlex.split(command)
        args = args[args.index("slurm/pretrain.sbatch") + 1:]
        proc = script("pretrain.sbatch", "--dry-run", *args)
        assert proc.returncode == 0, f"{command}\n{proc.stderr}"
