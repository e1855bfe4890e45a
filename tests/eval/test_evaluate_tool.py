"""tools/evaluate.py end to end on the tiny checkpoint (native backend at TP=2) and on its export
(lm-eval's hf backend): the same metrics, results.json and the paper-layout table; bad input in
one line with exit 2."""

import json
import os
import subprocess
import sys

import pytest

from tests.eval.conftest import REPO, require_task_data

TASKS = "lambada_openai,piqa,wikitext"  # last-word accuracy, multiple choice, rolling perplexity


def run_tool(*args, nproc=1, timeout=600):
    tool = [str(REPO / "tools" / "evaluate.py"), *map(str, args)]
    cmd = ([sys.executable, *tool] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *tool])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _metrics(folder):
    results = json.loads((folder / "results.json").read_text())["results"]
    return {(task, key): value for task, metrics in results.items()
            for key, value in metrics.items()
            if isinstance(value, float) and "stderr" not in key}


@pytest.mark.distributed
@pytest.mark.slow
def test_native_and_hf_backends_write_the_same_results(trained, exported, tmp_path):
    require_task_data()
    # PIQA's solutions outgrow the tiny model's 64 positions (a 512-piece vocabulary), which
    # the hf backend refuses: both backends run with a longer context (RoPE extends).
    common = ("--tasks", TASKS, "--limit", 4, "--batch-size", 4, "--max-length", 512)
    native = run_tool("--checkpoint", trained[1], "--tp", 2, *common,
                      "--output", tmp_path / "native", nproc=2)
    assert native.returncode == 0, native.stderr[-4000:]
    hf = run_tool("--hf", exported, *common, "--output", tmp_path / "hf")
    assert hf.returncode == 0, hf.stderr[-4000:]
    got, want = _metrics(tmp_path / "native"), _metrics(tmp_path / "hf")
    assert set(got) == set(want) and {t for t, _ in got} == set(TASKS.split(","))
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-4 * max(1.0, abs(value)), (key, got[key], value)
    table = (tmp_path / "native" / "results.md").read_text()
    assert "| Wiki ppl | LMB ppl | LMB acc | PIQA acc |" in table
    assert "--limit 4" in table
    assert "iiet loglikelihood" in native.stderr  # the progress bar over requests


def _refused(capsys, *argv):
    from tools.evaluate import main

    with pytest.raises(SystemExit) as stop:
        main(list(map(str, argv)))
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_unknown_task_is_one_line(tmp_path):
    proc = run_tool("--checkpoint", tmp_path, "--tasks", "piqa,no_such_task",
                    "--output", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no_such_task" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_missing_data_file_and_missing_model_are_one_line(tmp_path, capsys):
    empty = tmp_path / "no_data"
    empty.mkdir()
    line = _refused(capsys, "--hf", tmp_path, "--tasks", "piqa", "--data-dir", empty,
                    "--output", tmp_path / "out")
    assert str(empty) in line and "piqa" in line
    if require_task_data():
        line = _refused(capsys, "--checkpoint", tmp_path / "nowhere", "--tasks", "piqa",
                        "--output", tmp_path / "out")
        assert "nowhere" in line
        line = _refused(capsys, "--hf", tmp_path / "nowhere", "--tasks", "piqa",
                        "--output", tmp_path / "out")
        assert "nowhere" in line
    assert not (tmp_path / "out").exists()
