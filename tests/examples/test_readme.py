"""README.md's "Training your own" steps 1-4, run literally: the commands are parsed from the
README's code blocks, so a README edit that breaks a step fails here.

What the test changes, and nothing else:
- where things run: `.venv/bin/python` is this interpreter, `torchrun` is `python -m
  torch.distributed.run --standalone`, repository paths (tools/, examples/, pretrain_iiet.py)
  are absolute, `../shared/data` is the shared data folder, and `corpus/` holds six
  Gutenberg books;
- sizes, only through documented knobs: the size flags of the tools (SCALED_FLAGS) and `--set`
  overrides appended to each training command (TRAINING_SETS: the 340M model becomes the tiny
  preset, a few steps of a few short sequences, fp32 on CPU).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import run_script

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("IIET_SHARED_DATA", REPO.parent / "shared" / "data"))
# the six shortest: Alice, The Time Machine, The Devil's Dictionary, Treasure Island, Tom Sawyer,
# Frankenstein (2 MB); six documents, so that the README's 90,10,0 split holds one for validation
BOOKS = ("11-0.txt", "35-0.txt", "972.txt", "120-0.txt", "74-0.txt", "84-0.txt")

SCALED_FLAGS = {"--vocab-size": "2000", "--workers": "2", "--nproc-per-node": "2",
                "--limit": "16", "--batches": "2", "--train-steps": "4"}
TRAINING_SETS = ["model.preset=tiny", "parallel.precision=fp32", "data.seq_length=64",
                 "parallel.micro_batch_size=2", "parallel.global_batch_size=4",
                 "parallel.use_distributed_optimizer=false", "data.num_workers=0",
                 "schedule.train_steps=12", "schedule.warmup_steps=2",
                 "checkpoint.save_interval=6", "eval.interval=6", "eval.steps=2",
                 "logging.progress_bar=false", "logging.tensorboard=false"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def readme_commands() -> list[str]:
    """The shell commands of the "Training your own" section, continuations joined and
    comments dropped, in order."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Training your own", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def localise(command: str) -> list[str]:
    args = shlex.split(command)
    if args[0] == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args[1:]]
    elif args[0] == ".venv/bin/python":
        args = [sys.executable, *args[1:]]
    out = []
    for i, arg in enumerate(args):
        if i and args[i - 1] in SCALED_FLAGS:
            arg = SCALED_FLAGS[args[i - 1]]
        elif arg.startswith(("tools/", "examples/")) or arg == "pretrain_iiet.py":
            arg = str(REPO / arg)
        elif arg.startswith("../shared/data"):
            arg = str(SHARED) + arg[len("../shared/data"):]
        out.append(arg)
    if any(a.endswith("pretrain_iiet.py") for a in out):
        for override in TRAINING_SETS:
            out += ["--set", override]
    return out


def test_readme_commands_parse():
    commands = readme_commands()
    scripts = [next(a for a in shlex.split(c) if a.endswith(".py")) for c in commands]
    assert scripts == ["tools/train_tokenizer.py", "tools/preprocess_data.py", "pretrain_iiet.py",
                       "tools/evaluate.py", "tools/iiad_influence.py", "tools/iiad_plan.py",
                       "pretrain_iiet.py", "tools/convert_checkpoint.py"]


def test_training_your_own_steps_1_to_4_run_as_written(tmp_path):
    if not (SHARED / "gutenberg").is_dir() or not (SHARED / "piqa").is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the shared data is missing at {SHARED}")
        pytest.skip(f"shared data not found at {SHARED} (set IIET_SHARED_DATA)")
    (tmp_path / "corpus").mkdir()
    for book in BOOKS:
        (tmp_path / "corpus" / book).symlink_to(SHARED / "gutenberg" / book)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    for command in readme_commands():
        args = localise(command)
        if args[0] == sys.executable and args[1].endswith(".py"):  # forked: tests/forked.py
            proc = run_script(args[1], args[2:], cwd=tmp_path, env=env, timeout=900)
        else:
            proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=900)
        assert proc.returncode == 0, (f"README step failed: {command}\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    # what each step should have left behind
    assert (tmp_path / "tok/tokenizer.model").is_file()
    assert (tmp_path / "data/corpus.bin").is_file()
    assert (tmp_path / "outputs/iiet_340m/checkpoints/latest").is_file()
    assert (tmp_path / "eval/iiet_340m/results.json").is_file()
    assert (tmp_path / "e-iiet.yaml").is_file()
    assert (tmp_path / "outputs/e-iiet/checkpoints/latest").is_file()
    assert (tmp_path / "hf/e-iiet/config.json").is_file()
