"""One home per architecture: the registry entry is all the megatron side needs, and the HF side
mirrors it.

A toy scheme defined here, the explicit midpoint rule (two passes, no parameters of its own), is
registered at test time and nothing else is touched: config validation, the stack, the pass and
FLOP counts, the CLI choices and the conversion to HF all take it from the registry, and the HF
model runs it once its twin (an ARCHITECTURES entry of hf/modeling_iiet.py, the same step text)
is registered too.
"""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from megatron_iiet.hf import modeling_iiet
from megatron_iiet.hf.configuration_iiet import IIETConfig
from megatron_iiet.hf.modeling_iiet import ARCHITECTURES, IIETForCausalLM
from megatron_iiet.model.architectures import (REGISTRY, Architecture, architecture_names,
                                               get_architecture, passes_fixed,
                                               register_architecture)
from megatron_iiet.model.config import preset
from megatron_iiet.model.flops import passes_per_layer, step_flops
from tests.workers import VARIANTS, variant_id

LAYERS = 4  # the tiny preset's
SEQ, BATCH = 32, 2


def midpoint_step(s):
    """x + F(x + F(x)/2): explicit midpoint (RK2) with the layer's block as F."""
    f1 = s.run.residual(s.x)
    return s.x + s.run.residual(s.x + 0.5 * f1)


MIDPOINT = Architecture("midpoint", midpoint_step, passes_fixed(2))
MIDPOINT_VARIANT = ("midpoint", "history", None)


@pytest.fixture
def midpoint(monkeypatch):
    monkeypatch.setitem(REGISTRY, MIDPOINT.key, MIDPOINT)


@pytest.fixture
def midpoint_hf_mirror(monkeypatch):
    # the same step function serves both sides: the two dialects are one
    monkeypatch.setitem(ARCHITECTURES, "midpoint",
                        modeling_iiet.Architecture(midpoint_step, modeling_iiet.passes_fixed(2)))


def megatron_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters()}


def declared_names(architecture) -> set[tuple[str, str]]:
    return {pair for name in architecture.tensor_names for pair in name.pairs(LAYERS)}


def midpoint_model_and_declared_names():
    """In a spawned rank: the toy registered by the public call, one forward of a tiny model,
    its passes, FLOPs (analytic and counted) and full tensors; and for every built-in
    architecture, whether the parameters it builds beyond vanilla's are the ones it declares."""
    from tests.workers import build_tiny, flops_against_counter, micro_batches

    register_architecture(MIDPOINT)
    model = build_tiny(MIDPOINT_VARIANT).eval()
    ids = micro_batches(1, BATCH, SEQ)[0]["input_ids"]
    with torch.no_grad():
        logits = model(ids)
    vanilla = megatron_names(build_tiny(("vanilla", "history", None)))
    undeclared = {}
    for variant in VARIANTS:
        model_of_variant = build_tiny(variant)
        added = megatron_names(model_of_variant) - vanilla
        declared = {ours for ours, _ in declared_names(model_of_variant.decoder.architecture)}
        if added != declared:
            undeclared[variant_id(variant)] = sorted(added ^ declared)
    return {
        "ids": ids,
        "logits": logits,
        "passes": [layer.passes for layer in model.decoder.layers],
        "added_parameters": sorted(megatron_names(model) - vanilla),
        "flops": flops_against_counter([MIDPOINT_VARIANT], BATCH, SEQ)[variant_id(MIDPOINT_VARIANT)],
        "tensors": {name: p.detach().clone() for name, p in model.named_parameters()},
        "undeclared": undeclared,
    }


@pytest.fixture(scope="module")
def spawned():
    return spawn_local(midpoint_model_and_declared_names, 1)[0]


def test_a_registered_architecture_is_valid_everywhere(midpoint):
    assert "midpoint" in architecture_names()
    cfg = preset("tiny", architecture="midpoint")
    assert get_architecture("midpoint") is MIDPOINT
    assert passes_per_layer(cfg) == [2] * LAYERS and cfg.layer_iterations == [0] * LAYERS
    with pytest.raises(ValueError, match="iterations: only the iiet architecture iterates"):
        preset("tiny", architecture="midpoint", iterations=[1] * LAYERS)

    from megatron_iiet.training.config import TrainConfig, build_model_config

    train = TrainConfig()
    train.model.architecture = "midpoint"
    assert build_model_config(train, 512).architecture == "midpoint"

    from tools.convert_checkpoint import build_parser

    args = build_parser().parse_args(["megatron-to-hf", "ckpt", "out", "--expect-architecture",
                                      "midpoint"])
    assert args.expect_architecture == "midpoint"


def test_flops_derive_from_the_pass_count(midpoint):
    logits = 2 * BATCH * SEQ * 64 * 512
    vanilla = step_flops(preset("tiny", architecture="vanilla"), BATCH, SEQ).forward - logits
    toy = step_flops(preset("tiny", architecture="midpoint"), BATCH, SEQ).forward - logits
    assert toy == pytest.approx(2 * vanilla)


def test_unregistered_names_are_refused():
    with pytest.raises(ValueError, match="architecture: unknown 'midpoint'"):
        preset("tiny", architecture="midpoint")
    with pytest.raises(ValueError, match="registered already"):
        register_architecture(Architecture("vanilla", midpoint_step, passes_fixed(1)))


def test_the_registered_toy_builds_runs_and_counts_its_passes(spawned):
    assert spawned["passes"] == [2] * LAYERS
    assert spawned["added_parameters"] == []  # no parameters beyond the block's
    assert spawned["logits"].shape == (BATCH, SEQ, 512)
    assert torch.isfinite(spawned["logits"]).all()
    measured, analytic = spawned["flops"]
    assert abs(measured - analytic) <= 0.005 * measured


def test_every_architecture_builds_exactly_the_parameters_it_declares(spawned):
    assert spawned["undeclared"] == {}


def test_the_toy_converts_to_hf_and_its_mirror_gives_the_same_logits(spawned, midpoint,
                                                                      midpoint_hf_mirror):
    from megatron_iiet.hf.convert import hf_config_for, megatron_to_hf_tensors
    from megatron_iiet.hf.release_import import assemble_model, check_tensors

    cfg = preset("tiny", architecture="midpoint")
    hf_config = hf_config_for(cfg, cfg.vocab_size)
    assert hf_config.passes_per_layer() == [2] * LAYERS
    hf = megatron_to_hf_tensors(spawned["tensors"], cfg)
    model = assemble_model(check_tensors(hf, hf_config), hf_config)
    with torch.no_grad():
        logits = model(spawned["ids"], use_cache=False).logits
    assert (logits - spawned["logits"]).abs().max().item() < 1e-4
    # the mirror's KV cache holds the two slots per layer its scheme declares
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    prompt = spawned["ids"][:1, :8]
    cached = model.generate(prompt, use_cache=True, **kwargs)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **kwargs))


def test_the_hf_mirror_agrees_with_the_megatron_registry():
    """Same keys, pass counts, history flag; and the HF model's tensors beyond vanilla's are
    exactly the HF names the megatron registry declares (what the conversion writes)."""
    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                num_attention_heads=4)

    def hf_names(architecture, formulation):
        with torch.device("meta"):
            model = IIETForCausalLM(IIETConfig(**tiny, architecture=architecture,
                                               formulation=formulation))
        return set(model.state_dict())

    vanilla = hf_names("vanilla", "history")
    assert set(ARCHITECTURES) == set(REGISTRY)
    for key, architecture in REGISTRY.items():
        formulation = architecture.formulation or "history"
        twin = ARCHITECTURES[key]
        assert [twin.passes(r) for r in range(5)] == [architecture.passes(r) for r in range(5)]
        assert twin.uses_history == architecture.uses_history, key
        declared = {theirs for _, theirs in declared_names(architecture)}
        assert hf_names(architecture.name, formulation) - vanilla == declared, key
        its = [3, 0, 1, 2] if architecture.iterates else None
        megatron = preset("tiny", architecture=architecture.name, formulation=formulation,
                          iterations=its)
        hf_config = IIETConfig(**tiny, architecture=architecture.name, formulation=formulation,
                               iterations=megatron.layer_iterations if its else None)
        assert passes_per_layer(megatron) == hf_config.passes_per_layer(), key
