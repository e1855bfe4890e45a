"""Impossible config values, repeated YAML keys and YAML syntax errors are one `error:` line naming
the field (or the file and line), exit 2, found by the config loader before anything starts: no
run lock is taken, so none is left behind."""

import dataclasses
import typing

import pytest

from megatron_iiet.errors import BadInput
from megatron_iiet.locks import DIRECTORY_LOCK
from megatron_iiet.training.config import VALUE_RANGES, TrainConfig, load_config
from tests.training.conftest import REPO, base_overrides, launch
from tests.training.faults import one_line_error

IMPOSSIBLE = [
    ("data.seq_length=0", "data.seq_length: must be >= 1, got 0"),
    ("parallel.micro_batch_size=0", "parallel.micro_batch_size: must be >= 1"),
    ("parallel.global_batch_size=0", "parallel.global_batch_size: must be >= 1"),
    ("logging.log_interval=0", "logging.log_interval: must be >= 1"),
    ("schedule.train_steps=-5", "schedule.train_steps: must be >= 1, got -5"),
    ("schedule.warmup_steps=-1", "schedule.warmup_steps: must be >= 0"),
    ("model.num_layers=0", "model.num_layers: must be >= 1"),
    ("model.num_attention_heads=0", "model.num_attention_heads: must be >= 1"),
    ("model.hidden_dropout=1.5", "model.hidden_dropout: must be in [0, 1)"),
    ("parallel.tensor=0", "parallel.tensor: must be >= 1"),
    ("eval.steps=0", "eval.steps: must be >= 1"),
    ("optimizer.lr=-1e-3", "optimizer.lr: must be >= 0"),
    ("optimizer.lr=.nan", "optimizer.lr: must be >= 0, got nan"),
    ("optimizer.beta2=1", "optimizer.beta2: must be in [0, 1)"),
    ("checkpoint.save_interval=-2", "checkpoint.save_interval: must be >= 0"),
    ("schedule.exit_duration_minutes=0", "schedule.exit_duration_minutes: must be > 0"),
    ("data.num_workers=-1", "data.num_workers: must be >= 0"),
    ("seed=-1", "seed: must be >= 0"),
    ("data.split=abc", "data.split: 'abc' is not 'TRAIN,VALID,TEST'"),
    ("optimizer.lr=[1,", "override 'optimizer.lr=[1,': not valid YAML: line 1"),
]


def _numeric_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_fields(hint, f"{prefix}{f.name}.")
        elif {int, float} & set(typing.get_args(hint) or (hint,)):
            yield f"{prefix}{f.name}"


def test_every_numeric_field_has_a_range():
    ranged = {name for _, _, names in VALUE_RANGES for name in names}
    assert set(_numeric_fields(TrainConfig)) - ranged == set()


@pytest.mark.parametrize("override,message", IMPOSSIBLE, ids=[o for o, _ in IMPOSSIBLE])
def test_impossible_value_is_refused_naming_the_field(override, message):
    with pytest.raises(BadInput) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_repeated_section_or_key_is_refused_naming_it_and_its_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("optimizer:\n  lr: 1.0e-3\nschedule:\n  train_steps: 10\n"
                      "optimizer:\n  min_lr: 1.0e-5\n")
    with pytest.raises(BadInput, match=r"run.yaml: line 5: duplicate key 'optimizer' \(first "
                                       r"given on line 1\)"):
        load_config(str(config))
    config.write_text("optimizer: {lr: 1.0e-3, lr: 2.0e-3}\n")
    with pytest.raises(BadInput, match="line 1: duplicate key 'lr'"):
        load_config(str(config))
    # A merge key's entries may still be overridden: that is what `<<` is for.
    config.write_text("optimizer: &o {lr: 1.0e-3}\nschedule:\n  <<: {train_steps: 5}\n"
                      "  train_steps: 7\n  warmup_steps: 1\n")
    assert load_config(str(config)).schedule.train_steps == 7


@pytest.mark.parametrize("case", ["seq_length_0", "yaml_syntax", "repeated_section"])
def test_pretrain_says_it_in_one_line_before_taking_the_run_lock(tiny_data, tmp_path, case):
    """Real runs: seq_length=0 used to die of SIGFPE with no message and a lock left behind."""
    log = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text({"seq_length_0": "data:\n  seq_length: 0\n",
                       "yaml_syntax": "optimizer:\n  lr: [1.0e-3\nschedule: {}\n",
                       "repeated_section": "eval:\n  steps: 1\neval:\n  interval: 2\n"}[case])
    overrides = [o for o in base_overrides(tiny_data, log) if not o.startswith("data.seq_length")]
    proc = launch(overrides, entry=[str(REPO / "pretrain_iiet.py"), "--config", str(config)])
    line = one_line_error(proc, str(config) if case != "seq_length_0" else "data.seq_length")
    assert {"seq_length_0": "must be >= 1, got 0", "yaml_syntax": "not valid YAML: line 3",
            "repeated_section": "line 3: duplicate key 'eval'"}[case] in line
    assert not (log / DIRECTORY_LOCK).exists() and not log.exists()
