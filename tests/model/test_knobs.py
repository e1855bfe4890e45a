"""model/config.py's KNOBS is the one declaration of where a model-config field goes: every field
IIETTransformerConfig adds to megatron-core's is listed there, the training config's model section
is derived from it, and every HF name it gives is a field of the exported config."""

import dataclasses
import inspect
import typing

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_iiet.hf.configuration_iiet import IIETConfig
from megatron_iiet.hf.mapping import config_fields
from megatron_iiet.model.config import KNOBS, IIETTransformerConfig
from megatron_iiet.training.config import ModelSection, load_config


def test_every_field_the_model_config_adds_is_a_knob():
    megatron = {f.name for f in dataclasses.fields(TransformerConfig)}
    added = [f.name for f in dataclasses.fields(IIETTransformerConfig) if f.name not in megatron]
    assert sorted(set(added) - set(KNOBS)) == []
    fields = {f.name for f in dataclasses.fields(IIETTransformerConfig)}
    assert sorted(set(KNOBS) - fields) == []


def test_every_copied_knob_reaches_the_exported_config_and_its_json():
    """IIETConfig names most of them as parameters; one it does not (max_iterations, a new knob)
    is kept by PretrainedConfig as an attribute and written to config.json all the same."""
    model = IIETTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                  ffn_hidden_size=176)
    copied = config_fields()
    assert dict(copied) == {name: k.hf for name, k in KNOBS.items() if k.hf and not k.hf_derived}
    values = {theirs: getattr(model, ours) for ours, theirs in copied}
    exported = IIETConfig(**values)
    reread = IIETConfig.from_dict(exported.to_dict())
    for ours, theirs in copied:
        assert getattr(reread, theirs) == getattr(model, ours), theirs
    parameters = set(inspect.signature(IIETConfig.__init__).parameters)
    derived = [k.hf for k in KNOBS.values() if k.hf_derived]
    assert sorted(set(derived) - parameters) == []


def test_the_model_section_is_the_run_knobs_typed_as_the_model_config():
    hints = typing.get_type_hints(ModelSection)
    assert list(hints) == ["preset"] + [name for name, k in KNOBS.items() if k.run]
    assert hints["num_layers"] == typing.Optional[int]
    assert hints["iterations"] == typing.Optional[list[int]]
    assert hints["hidden_dropout"] == typing.Optional[float]
    cfg = load_config(None, ["model.history_init=current", "model.num_layers=3"])
    assert (cfg.model.history_init, cfg.model.num_layers) == ("current", 3)
