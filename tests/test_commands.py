"""Every tool is one module of megatron_iiet/commands, run two ways that must not drift apart: as
`python tools/<name>.py` (what the docs, SLURM scripts and torchrun launches name) and as the
installed console command `iiet-<name>` ([project.scripts]); neither relies on sys.path edits."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import megatron_iiet.commands
from tests.forked import run_script

REPO = Path(__file__).resolve().parents[1]
COMMANDS = sorted(m.name for m in pkgutil.iter_modules(megatron_iiet.commands.__path__))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def console_name(module: str) -> str:
    return "iiet-" + module.replace("_", "-")


def test_the_commands_are_found():
    # an empty list would make every parametrized test below pass vacuously
    assert {"convert_checkpoint", "evaluate", "preprocess_data", "sweep"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_its_script_runs_it(name):
    script = REPO / "tools" / f"{name}.py"
    assert script.is_file(), f"{script}: missing (a one-line script that runs the command)"
    proc = run_script(script, ["--help"], env=ENV, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the help is the module's docstring: the script runs this module, not a copy of it
    summary = importlib.import_module(f"megatron_iiet.commands.{name}").__doc__.splitlines()[0]
    assert summary in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_it_is_an_installed_console_command(name):
    target = f"megatron_iiet.commands.{name}:main"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get(console_name(name)) == target
    installed = importlib.metadata.entry_points(group="console_scripts", name=console_name(name))
    assert [ep.value for ep in installed] == [target], (
        "the installed entry points are stale: pip install --no-deps -e .")
    module = importlib.import_module(f"megatron_iiet.commands.{name}")
    assert next(iter(installed)).load() is module.main


def test_every_console_command_has_its_module():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(map(console_name, COMMANDS))


# (file, the one call allowed there): bench_preprocess.py runs Megatron-LM's own preprocessing
# on that checkout's `megatron` package
ALLOWED_PATH_EDITS = {("bench/bench_preprocess.py", "sys.path.insert(0, str(root))")}


def test_no_script_edits_sys_path():
    """The package is installed (editable): a script that puts the checkout first on sys.path
    could import another tree's megatron_iiet than the one installed."""
    found = set()
    for folder in ("tools", "bench", "examples", "megatron_iiet/commands"):
        for path in sorted((REPO / folder).glob("*.py")):
            for line in path.read_text().splitlines():
                if re.search(r"\bsys\.path\.(insert|append)\(", line):
                    found.add((path.relative_to(REPO).as_posix(), line.split("#")[0].strip()))
    assert found <= ALLOWED_PATH_EDITS, sorted(found - ALLOWED_PATH_EDITS)


def test_an_operator_mistake_in_a_console_command_is_one_line(tmp_path):
    """The installed command, in a fresh process away from the checkout, ends like the script."""
    command = Path(sys.executable).parent / console_name("preprocess_data")
    assert command.is_file(), f"{command}: not installed (pip install --no-deps -e .)"
    proc = subprocess.run([str(command), "--input", str(tmp_path / "corpus.txt"), "--tokenizer",
                           str(tmp_path / "missing.model"), "--output-prefix",
                           str(tmp_path / "out" / "corpus"), "--no-progress"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "missing.model" in lines[0]
    assert not (tmp_path / "out").exists()
