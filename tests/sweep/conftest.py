"""The sweep tests share the training tests' tiny corpus, and a one-run IIET cell on it."""

import os
from pathlib import Path

import yaml

from tests.forked import run_script
from tests.training.conftest import tiny_data  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def launch_iiet_cell(tmp_path: Path, data, steps: int, max_iterations: int,
                     **overrides) -> tuple[Path, Path]:
    """A one-run sweep file (one tiny IIET of 2 layers x 32, ``steps`` steps of 4 x 32 tokens,
    ``overrides`` added to its ``set``) launched to the end: (the sweep file, the run's folder)."""
    sweep, runs = launch_cell(tmp_path, data, steps, max_iterations, ("iiet",), **overrides)
    return sweep, runs["iiet"]


def launch_cell(tmp_path: Path, data, steps: int, max_iterations: int,
                architectures: tuple[str, ...], **overrides) -> tuple[Path, dict[str, Path]]:
    """The same cell with one run of each of ``architectures`` (one seed, one LR each), launched
    to the end: (the sweep file, {architecture: its run's folder})."""
    sweep = tmp_path / "cell.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "cell", "base": str(REPO / "examples" / "tiny_iiet.yaml"),
        "output": str(tmp_path / "out"), "architectures": list(architectures),
        "set": {"data.train": data.data_prefix, "data.valid": data.data_prefix,
                "data.tokenizer": data.tokenizer_model, "data.num_workers": 0,
                "data.cache_dir": str(tmp_path / "cache"), "logging.progress_bar": False,
                "logging.tensorboard": False, "eval.steps": 1, **overrides},
        "arch_set": {"iiet": {"model.max_iterations": max_iterations}},
        "sizes": [{"name": "xs", "num_layers": 2, "hidden_size": 32}],
        "tokens": [steps * 4 * 32], "batch": {"global_batch_size": 4, "micro_batch_size": 4,
                                              "seq_length": 32},
        "shape_rules": {"head_dim": 16}, "lr": {"values": {a: 3e-3 for a in architectures}}}))
    launched = run_script(str(REPO / "tools" / "sweep.py"), ["launch", str(sweep)], cwd=REPO,
                          env=ENV, timeout=900)
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    runs = {a: [p for p in (tmp_path / "out" / "runs").iterdir() if p.name.startswith(a + "_")]
            for a in architectures}
    assert all(len(found) == 1 for found in runs.values()), runs
    return sweep, {a: found[0] for a, found in runs.items()}
