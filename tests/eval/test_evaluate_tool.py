"""tools/evaluate.py end to end on the tiny checkpoint (native backend at TP=2) and on its export
(lm-eval's hf backend): the same metrics, results.json and the paper-layout table; bad input in
one line with exit 2; one writer per --output, earlier results kept; no code from an --hf
folder runs unless --trust-remote-code."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.forked import run_script

from tests.eval.conftest import REPO, require_task_data

TASKS = "lambada_openai,piqa,wikitext"  # last-word accuracy, multiple choice, rolling perplexity


def run_tool(*args, nproc=1, timeout=600, env=None):
    tool = [str(REPO / "tools" / "evaluate.py"), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if nproc == 1:  # forked from this process when it can be (tests/forked.py)
        return run_script(tool[0], tool[1:], cwd=REPO, env=env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", *tool], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


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


def test_existing_results_are_kept_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    earlier = '{"results": {"piqa": {"acc,none": 0.5}}}'
    (out / "results.json").write_text(earlier)
    line = _refused(capsys, "--hf", tmp_path / "nowhere", "--tasks", "piqa", "--output", out)
    assert f"{out / 'results.json'}: exists" in line and "--overwrite" in line, line
    # --overwrite lets it past that check (and the run then fails on the missing model or task
    # data, writing nothing).
    line = _refused(capsys, "--hf", tmp_path / "nowhere", "--tasks", "piqa", "--output", out,
                    "--overwrite")
    assert "exists" not in line, line
    assert (out / "results.json").read_text() == earlier


def test_a_second_evaluation_into_the_same_output_refuses_at_once(tmp_path):
    """This test process holds the output's lock as a running evaluation's writer does (the
    same call, a live process), so the refusal does not depend on how long a real one takes."""
    from megatron_iiet.locks import exclusive_output

    out = tmp_path / "out"
    with exclusive_output(out, "another evaluation writing these results", "wait"):
        proc = run_tool("--hf", tmp_path / "nowhere", "--tasks", "piqa", "--output", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{out}: busy" in lines[0] and f"pid {os.getpid()}" in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "out.lock").exists()


PAYLOAD = "\nimport pathlib as _p\n_p.Path({marker!r}).open('a').write(__name__ + '\\n')\n"


@pytest.mark.distributed  # the exported fixture is trained by 2 spawned ranks
def test_hf_backend_runs_no_code_from_the_folder_unless_asked(exported, tmp_path, capsys):
    require_task_data()
    folder = shutil.copytree(exported, tmp_path / "planted")
    marker = tmp_path / "ran.txt"
    for code in folder.glob("*.py"):  # what a tampered copy of an export would carry
        code.write_text(code.read_text() + PAYLOAD.format(marker=str(marker)))
    common = ("--tasks", "lambada_openai", "--limit", 2, "--max-length", 512,
              "--hf", folder)
    env = {"HF_HOME": str(tmp_path / "hf_home")}  # transformers' copy of remote code goes here
    proc = run_tool(*common, "--output", tmp_path / "out", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not marker.exists(), marker.read_text()
    assert "lambada_openai" in json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    # A model whose class only the folder's code defines: one line naming the flag, which then
    # runs that code (for a model_type this package registers, its own classes still win).
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "someone_elses"}))
    line = _refused(capsys, *common, "--output", tmp_path / "other")
    assert "someone_elses" in line and "--trust-remote-code" in line, line
    assert not marker.exists()
    proc = run_tool(*common, "--output", tmp_path / "remote", "--trust-remote-code", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "modeling_iiet" in marker.read_text()
