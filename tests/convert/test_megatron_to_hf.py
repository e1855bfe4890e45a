"""megatron -> HF: for every architecture and every source layout (TP=1, TP=2, PP=2) the HF
model's logits equal the megatron model's, and HF -> megatron -> HF gives back identical tensors.

The checkpoints hold random weights with every vector (history rows, LayerNorms, RMSNorms,
PCformer's alpha) moved off its init, so a wrong or skipped mapping changes the logits.
"""

import json

import pytest
import torch

from tests.convert.conftest import hf_state
from tests.convert.workers import (LAYOUTS, PADDED_VOCAB, TOKENIZER_VOCAB, UNTIED, VARIANTS,
                                   input_ids, variant_id)

pytestmark = pytest.mark.distributed

VARIANT_IDS = [variant_id(v) for v in VARIANTS]
LOGIT_TOL = 1e-4


def _hf_logits(folder):
    from megatron_iiet.hf import IIETForCausalLM

    model = IIETForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids()).logits, model


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("vid", VARIANT_IDS)
def test_hf_logits_equal_megatron(checkpoints, converted, vid, layout):
    megatron_logits = checkpoints[1]
    logits, model = _hf_logits(converted / "hf" / f"{vid}-{layout}")
    assert model.config.vocab_size == PADDED_VOCAB  # padding kept by default
    reference = megatron_logits[(vid, "tp1")]
    assert (logits - reference).abs().max().item() < LOGIT_TOL
    if layout == "tp2":  # also against the TP=2 model's own (gathered) logits
        assert (logits - megatron_logits[(vid, "tp2")]).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("vid", VARIANT_IDS)
def test_every_layout_exports_the_same_tensors(converted, vid):
    tp1 = hf_state(converted / "hf" / f"{vid}-tp1")
    for layout in ("tp2", "pp2"):
        other = hf_state(converted / "hf" / f"{vid}-{layout}")
        assert set(other) == set(tp1)
        assert all(torch.equal(other[k], tp1[k]) for k in tp1), layout


def test_mapped_vectors_are_not_their_init(converted):
    """Guards the tests above: the perturbation reached every mapped vector."""
    from megatron_iiet.hf.modeling_iiet import uniform_lower_triangular

    state = hf_state(converted / "hf" / "iiet-history-tp1")
    W, Wc = state["model.history.weight"], state["model.history.weight_c"]
    init = uniform_lower_triangular(W.shape[0])
    rows = slice(1, None)  # row 0 is never read and keeps its init
    assert not torch.allclose(W[rows], init[rows]) and not torch.allclose(Wc[rows], init[rows])
    assert torch.equal(W[0], init[0]) and torch.equal(torch.triu(W, 1), torch.zeros_like(W))
    assert not torch.allclose(state["model.history.layer_norms.2.weight"], torch.ones(64))
    assert not torch.allclose(state["model.norm.weight"], torch.ones(64))
    pc = hf_state(converted / "hf" / "pcformer_rk4-tp1")
    assert pc["model.alpha"].item() != 0.5 and len([k for k in pc if "RK_norm" in k]) == 8


def test_config_and_folder_contents(converted):
    folder = converted / "hf" / "iiet-history-3102-pp2"
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "iiet" and config["formulation"] == "history"
    assert config["iterations"] == [3, 1, 0, 2] and config["max_iterations"] == 3
    assert config["tie_word_embeddings"] is ("iiet-history-3102" not in UNTIED)
    assert config["num_key_value_heads"] == 4 and config["vocab_size"] == PADDED_VOCAB
    assert "lm_head.weight" in hf_state(folder)  # untied variant
    gqa = json.loads((converted / "hf" / "iiet-history-tp1" / "config.json").read_text())
    assert gqa["num_key_value_heads"] == 2
    fixed = json.loads((converted / "hf" / "iiet-fixed_point-tp2" / "config.json").read_text())
    assert fixed["formulation"] == "fixed_point" and "model.history.weight" not in hf_state(
        converted / "hf" / "iiet-fixed_point-tp2")
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "configuration_iiet.py", "modeling_iiet.py",
            "cache_iiet.py", "model.safetensors", "README.md", "tokenizer.json", "tokenizer.model",
            "tokenizer_config.json"} <= files
    card = (folder / "README.md").read_text()
    assert "pipeline" in card and "architecture: iiet" in card  # the training config is in it
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


@pytest.mark.parametrize("vid", VARIANT_IDS)
def test_hf_to_megatron_to_hf_is_identical(converted, vid):
    original = converted / "hf" / f"{vid}-tp1"
    back = converted / "back" / vid
    a, b = hf_state(original), hf_state(back)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    config_a = json.loads((original / "config.json").read_text())
    config_b = json.loads((back / "config.json").read_text())
    for key in ("architecture", "formulation", "iterations", "max_iterations", "vocab_size",
                "num_key_value_heads", "tie_word_embeddings", "intermediate_size"):
        assert config_a[key] == config_b[key], key
    meta = json.loads((converted / "meg" / vid / "iter_0000000" / "meta.json").read_text())
    assert meta["model_only"] is True and meta["step"] == 0
    assert meta["architecture"]["vocab_size"] == PADDED_VOCAB
    assert TOKENIZER_VOCAB < PADDED_VOCAB
