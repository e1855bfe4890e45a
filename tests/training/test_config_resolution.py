"""The config is resolved once: model settings fail at load time, and the model defaults are
written in one place (the model config), which a training config inherits."""

import dataclasses

import pytest

from megatron_iiet.model.config import IIETTransformerConfig
from megatron_iiet.training.config import (
    ModelSection, TrainConfig, build_model_config, load_config, padded_vocab_size)


@pytest.mark.parametrize("override,message", [
    ("model.iterations=[1,2]", "model.iterations: needs one entry per layer (4), got 2"),
    ("model.architecture=rk3", "model.architecture: unknown 'rk3'"),
    ("model.preset=7b", "model.preset: unknown '7b'"),
    ("model.iteration_checkpointing=some", "model.iteration_checkpointing: unknown 'some'"),
    ("model.compile=maybe", "model.compile: expected bool, got 'maybe'"),
])
def test_a_bad_model_setting_fails_when_the_config_is_loaded(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        load_config(None, [override])


def test_unset_model_fields_take_the_model_configs_defaults():
    built = build_model_config(TrainConfig(), padded_vocab_size(500))
    defaults = {f.name: f.default for f in dataclasses.fields(IIETTransformerConfig)}
    for name in ("architecture", "formulation", "max_iterations", "iteration_checkpointing",
                 "compile", "hidden_dropout", "attention_dropout", "init_method_std"):
        assert getattr(ModelSection(), name) is None, f"{name}: a second default"
        assert getattr(built, name) == defaults[name], name
    assert built.vocab_size == 512


def test_model_compile_reaches_the_model_config():
    built = build_model_config(load_config(None, ["model.compile=true"]), padded_vocab_size(500))
    assert built.compile is True


def test_inference_rebuilds_a_compiled_runs_model_eagerly():
    # Evaluation's varying sequence lengths would recompile a compiled pass for each new shape.
    from megatron_iiet.hf.megatron_model import single_process_model_config

    train_cfg = load_config(None, ["model.compile=true"])
    assert single_process_model_config(train_cfg, padded_vocab_size(500)).compile is False


def test_print_config_prints_the_resolved_config_that_loads_back_unchanged(tmp_path):
    """--print-config: the YAML after every --set and default, then exit 0 without training;
    fed back as --config it gives the same config. --help lists every section's fields."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from megatron_iiet.training.config import load_config

    repo = Path(__file__).resolve().parents[2]
    args = ["--config", "examples/tiny_iiet.yaml", "--set", "optimizer.lr=5e-4",
            "--set", "logging.dir=" + str(tmp_path / "never")]
    proc = subprocess.run([sys.executable, "pretrain_iiet.py", *args, "--print-config"],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["optimizer"]["lr"] == 5e-4 and printed["schedule"]["train_steps"] > 0
    assert not (tmp_path / "never").exists(), "--print-config must not start a run"
    (tmp_path / "resolved.yaml").write_text(proc.stdout)
    expected = load_config(str(repo / "examples/tiny_iiet.yaml"), args[3::2][:2]).to_dict()
    assert load_config(str(tmp_path / "resolved.yaml")).to_dict() == expected
    helped = subprocess.run([sys.executable, "pretrain_iiet.py", "--help"], cwd=repo,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0
    for section in printed:
        assert f"  {section}" in helped.stdout, section
    assert "warmup_steps=" in helped.stdout and "wandb_project=" in helped.stdout
