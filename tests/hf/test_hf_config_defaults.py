"""The exported HF config defaults to what training defaults to: every field IIETConfig shares
with the megatron model config (IIETTransformerConfig) and the training config's model section
(ModelSection) has the same default on all sides that set one."""

import dataclasses
import inspect

from megatron_iiet.hf.configuration_iiet import DEFAULT_ITERATIONS, IIETConfig
from megatron_iiet.hf.mapping import config_fields
from megatron_iiet.model.config import KNOBS, IIETTransformerConfig
from megatron_iiet.training.config import ModelSection

# Sizes have no megatron default: the preset sets them (ModelSection's are None, megatron's 0).
SET_BY_THE_PRESET = {"hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads"}
# (megatron field, IIETConfig field) of what the conversion derives instead of copying.
SHARED_ELSEWHERE = tuple((name, knob.hf) for name, knob in KNOBS.items() if knob.hf_derived)


def _dataclass_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


def _hf_defaults() -> dict:
    parameters = inspect.signature(IIETConfig.__init__).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    # max_iterations rides in **kwargs; without `iterations` every layer runs this many.
    defaults["max_iterations"] = DEFAULT_ITERATIONS
    return defaults


def test_every_shared_field_has_one_default():
    hf, megatron = _hf_defaults(), _dataclass_defaults(IIETTransformerConfig)
    section = _dataclass_defaults(ModelSection)
    compared = []
    for ours, theirs in config_fields() + SHARED_ELSEWHERE:
        if ours in SET_BY_THE_PRESET:
            assert section.get(ours) is None, ours  # really left to the preset
            continue
        assert hf[theirs] == megatron[ours], (theirs, hf[theirs], ours, megatron[ours])
        if section.get(ours) is not None:
            assert section[ours] == megatron[ours], ours
        compared.append(ours)
    assert len(compared) == len(config_fields()) + len(SHARED_ELSEWHERE) - len(SET_BY_THE_PRESET)


def test_the_default_hf_config_runs_the_default_iterations():
    config = IIETConfig(num_hidden_layers=2)
    megatron = _dataclass_defaults(IIETTransformerConfig)
    assert config.iterations == [megatron["max_iterations"]] * 2
    assert (config.architecture, config.formulation) == (megatron["architecture"],
                                                         megatron["formulation"])
