"""Tiny configs and random weights shared by the HF tests."""

import torch

from megatron_iiet.hf import IIETConfig, IIETForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)

# (id, extra config) for every architecture and the iteration plans the brief names.
ARCH_CASES = [
    ("vanilla", dict(architecture="vanilla")),
    ("ode_rk2", dict(architecture="ode_rk2")),
    ("ode_rk2_gated", dict(architecture="ode_rk2_gated")),
    ("ode_rk4", dict(architecture="ode_rk4")),
    ("pcformer_rk2", dict(architecture="pcformer_rk2")),
    ("pcformer_rk4", dict(architecture="pcformer_rk4")),
    ("iiet_r3", dict(architecture="iiet", iterations=3)),
    ("iiet_mixed", dict(architecture="iiet", iterations=[3, 0, 1, 2])),
    ("fixed_point_r3", dict(architecture="iiet", formulation="fixed_point", iterations=3)),
    ("fixed_point_mixed", dict(architecture="iiet", formulation="fixed_point", iterations=[0, 2, 1, 3])),
    ("iiet_gqa_untied", dict(architecture="iiet", num_key_value_heads=2, tie_word_embeddings=False)),
]


def tiny_config(**overrides):
    return IIETConfig(**{**TINY, **overrides})


@torch.no_grad()
def randomize_(model, seed=0):
    """Random weights large enough that every pass, norm and history weight matters.

    Projections get std ~1/sqrt(fan_in) (so activations stay O(1) through many passes), norm
    weights and biases are perturbed away from 1/0, the history matrices become random
    lower-triangular mixes and alpha moves off 0.5.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("history.weight") or name.endswith("history.weight_c"):
            size = p.shape[0]
            mix = torch.rand(size, size, generator=gen) + 0.2
            p.copy_(torch.tril(mix) / torch.tril(mix).sum(-1, keepdim=True))
        elif name.endswith("alpha"):
            p.fill_(0.3 + 0.4 * torch.rand(1, generator=gen).item())
        elif "norm" in name.lower() and name.endswith("weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def tiny_model(seed=0, **overrides):
    return randomize_(IIETForCausalLM(tiny_config(**overrides)), seed).eval()


def weights(model):
    """State dict as the HF export holds it (no lm_head entry when tied)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def export(tmp_path, seed=11, **overrides):
    """(model, folder): a tiny random model saved with save_pretrained under tmp_path/export."""
    model = tiny_model(seed=seed, **overrides)
    folder = tmp_path / "export"
    model.save_pretrained(folder)
    return model, folder
