"""training/ is the layer the features build on: it imports none of them (issue 30). The run is
assembled above them, in megatron_iiet/run.py."""

import ast
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[2] / "megatron_iiet" / "training"
ABOVE = ("megatron_iiet.eval", "megatron_iiet.iiad", "megatron_iiet.sweep", "megatron_iiet.hf",
         "megatron_iiet.run", "megatron_iiet.slurm", "megatron_iiet.cli", "megatron_iiet.commands",
         # preparing the built-in corpus is the entry points' (run.py, the commands), not the loop's
         "megatron_iiet.data.prepare")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_training_imports_nothing_above_it():
    upward = {f"{path.name}: {module}" for path in sorted(TRAINING.glob("*.py"))
              for module in imported_modules(path)
              if any(module == pkg or module.startswith(pkg + ".") for pkg in ABOVE)}
    assert not upward, sorted(upward)


def test_the_check_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from megatron_iiet.iiad.distill import build_distillation\n")
    assert "megatron_iiet.iiad.distill" in imported_modules(sample)


def test_the_library_prepares_no_data_it_is_not_given():
    """With data.train unset, training/ takes the built-in corpus the entry point prepared, and
    refuses in one line when it got none (it used to prepare it itself)."""
    import pytest

    from megatron_iiet.data.prepare import builtin_corpus
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training.config import TrainConfig
    from megatron_iiet.training.data import resolve_sources

    cfg = TrainConfig()
    assert cfg.data.train is None
    with pytest.raises(BadInput, match="data.train: not set, and no built-in corpus was prepared"):
        resolve_sources(cfg)
    cfg.data.train = "some/prefix"
    assert builtin_corpus(cfg.data, rank=0) is None  # named data: nothing to prepare
