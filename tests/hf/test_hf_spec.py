"""The HF model against an independent plain-torch implementation of spec/IIET.md."""

import pytest
import torch
from torch import nn

from hf_helpers import ARCH_CASES, tiny_config, tiny_model, weights
from hf_spec_reference import block, reference_cfg, reference_logits
from megatron_iiet.hf import IIETForCausalLM

TOL = 1e-4


def ids(seed=0, batch=2, seq=9):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case,extra", ARCH_CASES, ids=[c for c, _ in ARCH_CASES])
def test_logits_match_spec_reference(case, extra):
    model = tiny_model(seed=1, **extra)
    tokens = ids()
    with torch.no_grad():
        got = model(tokens, use_cache=False).logits
    want = reference_logits(weights(model), reference_cfg(model.config), tokens)
    assert got.abs().max() > 0.1  # the comparison below must not be between near-zero tensors
    assert (got - want).abs().max().item() < TOL


def test_architectures_are_different_functions():
    """Same layer weights, different loops: the spec's forms must not collapse into one another."""
    tokens = ids()
    outs = {}
    for case, extra in ARCH_CASES[:8]:
        model = tiny_model(seed=1, **extra)
        with torch.no_grad():
            outs[case] = model(tokens, use_cache=False).logits
    names = list(outs)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            assert (outs[names[a]] - outs[names[b]]).abs().max() > 1e-3, (names[a], names[b])


@pytest.mark.parametrize("iterations", [[3, 3, 3, 3], [3, 0, 1, 2]])
def test_history_with_one_hot_mixing_and_identity_norms_is_repeated_block(iterations):
    """Spec 5b: W, Wc one-hot on the current layer and Np, Nc = identity -> Block applied r+1 times."""
    model = tiny_model(seed=2, architecture="iiet", iterations=iterations)
    hist = model.model.history
    with torch.no_grad():
        hist.weight.copy_(torch.eye(hist.weight.shape[0]))
        hist.weight_c.copy_(torch.eye(hist.weight.shape[0]))
    hist.layer_norms = nn.ModuleList(nn.Identity() for _ in hist.layer_norms)
    hist.rouge_predictions_norm = nn.ModuleList(nn.Identity() for _ in hist.rouge_predictions_norm)
    tokens = ids(seed=3)
    sd, cfg = weights(model), reference_cfg(model.config)
    with torch.no_grad():
        got = model(tokens, use_cache=False).logits
        x = sd["model.embed_tokens.weight"][tokens]
        for i, r in enumerate(iterations):
            for _ in range(r + 1):
                x = block(sd, i, x, cfg)
        x = model.model.norm(x)
        want = x @ sd["model.embed_tokens.weight"].T
    assert (got - want).abs().max().item() < TOL


def test_fixed_point_is_the_direct_implicit_euler_loop():
    """Spec 5a written out with the layer's own module: y = x + F(y), r times after y_0 = x + F(x)."""
    r = 3
    model = tiny_model(seed=4, architecture="iiet", formulation="fixed_point", iterations=r)
    tokens = ids(seed=5)
    with torch.no_grad():
        got = model(tokens, use_cache=False).logits
        sd, cfg = weights(model), reference_cfg(model.config)
        x = sd["model.embed_tokens.weight"][tokens]
        for i in range(cfg["layers"]):
            F_ = lambda u, i=i: block(sd, i, u, cfg) - u  # noqa: E731
            y = x + F_(x)
            for _ in range(r):
                y = x + F_(y)
            x = y
        want = model.lm_head(model.model.norm(x))
    assert (got - want).abs().max().item() < TOL


def test_fixed_point_with_zero_iterations_is_vanilla():
    vanilla = tiny_model(seed=6, architecture="vanilla")
    fixed = IIETForCausalLM(tiny_config(architecture="iiet", formulation="fixed_point", iterations=0)).eval()
    fixed.load_state_dict(vanilla.state_dict())
    tokens = ids(seed=7)
    with torch.no_grad():
        diff = (vanilla(tokens).logits - fixed(tokens).logits).abs().max().item()
    assert diff < 1e-6


def test_fewer_iterations_reuse_the_same_weights():
    """Spec 5c: iterations is config only; an r=3 model runs an E-IIET plan with its weights."""
    full = tiny_model(seed=8, architecture="iiet", iterations=3)
    plan = [1, 0, 3, 2]
    pruned = IIETForCausalLM(tiny_config(architecture="iiet", iterations=plan)).eval()
    missing, unexpected = pruned.load_state_dict(full.state_dict(), strict=True)
    assert not missing and not unexpected
    tokens = ids(seed=9)
    with torch.no_grad():
        got = pruned(tokens).logits
        full_logits = full(tokens).logits
    want = reference_logits(weights(full), {**reference_cfg(full.config), "iterations": plan}, tokens)
    assert (got - want).abs().max().item() < TOL
    assert (got - full_logits).abs().max().item() > 1e-3


def test_loss_is_next_token_cross_entropy():
    model = tiny_model(seed=10, architecture="iiet", iterations=1)
    tokens = ids(seed=11)
    labels = tokens.clone()
    labels[0, 3] = -100
    out = model(tokens, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 128)
    want = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, want)
    out.loss.backward()
    assert model.model.history.weight.grad is not None
