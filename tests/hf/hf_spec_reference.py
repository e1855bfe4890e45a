"""An independent, plain-torch implementation of spec/IIET.md, used as the tests' oracle.

It reads a state dict with the HF names and recomputes the logits with its own functions (explicit
softmax attention, pairwise RoPE, history as a matrix product over stacked states) so that a bug in
the model code cannot hide by being shared with the check.
"""

import math

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def layer_norm(sd, prefix, x, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]


def rope(x, theta):
    """x: [batch, heads, seq, head_dim]; rotates pairs (j, j + head_dim/2) by pos * theta^(-2j/hd)."""
    head_dim, seq = x.shape[-1], x.shape[-2]
    half = head_dim // 2
    freqs = torch.tensor([theta ** (-2.0 * j / head_dim) for j in range(half)], dtype=torch.float32)
    angle = torch.arange(seq, dtype=torch.float32)[:, None] * freqs[None, :]
    c, s = torch.cos(angle), torch.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def attention(sd, p, x, cfg):
    batch, seq, _ = x.shape
    heads, kv_heads = cfg["heads"], cfg["kv_heads"]
    hd = cfg["hidden"] // heads
    q = (x @ sd[p + "q_proj.weight"].T).view(batch, seq, heads, hd).permute(0, 2, 1, 3)
    k = (x @ sd[p + "k_proj.weight"].T).view(batch, seq, kv_heads, hd).permute(0, 2, 1, 3)
    v = (x @ sd[p + "v_proj.weight"].T).view(batch, seq, kv_heads, hd).permute(0, 2, 1, 3)
    q, k = rope(q, cfg["theta"]), rope(k, cfg["theta"])
    kv_of_head = [h // (heads // kv_heads) for h in range(heads)]
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = (probs @ v).permute(0, 2, 1, 3).reshape(batch, seq, heads * hd)
    return out @ sd[p + "o_proj.weight"].T


def block(sd, i, u, cfg):
    """Block_i(u) = h + MLP(N2(h)), h = u + Attn(N1(u))."""
    p = f"model.layers.{i}."
    h = u + attention(sd, p + "self_attn.", rms_norm(u, sd[p + "input_layernorm.weight"], cfg["rms_eps"]), cfg)
    n = rms_norm(h, sd[p + "post_attention_layernorm.weight"], cfg["rms_eps"])
    gate, up = n @ sd[p + "mlp.gate_proj.weight"].T, n @ sd[p + "mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T


def history_mix(matrix, row, states):
    """sum_{k<=row} matrix[row, k] S_k as one product over the stacked states."""
    stacked = torch.stack(states[: row + 1])  # [row+1, b, s, d]
    return torch.einsum("k,kbsd->bsd", matrix[row, : row + 1], stacked)


def layer_vanilla(sd, i, x, cfg, states):
    return block(sd, i, x, cfg)


def layer_rk2(sd, i, x, cfg, states, gated=False):
    f1 = block(sd, i, x, cfg) - x
    f2 = block(sd, i, x + f1, cfg) - (x + f1)
    if not gated:
        return x + 0.5 * f1 + 0.5 * f2
    g = torch.sigmoid(torch.cat([f1, f2], -1) @ sd[f"model.layers.{i}.gate_linear.weight"].T)
    return x + g * f1 + (1 - g) * f2


def layer_rk4(sd, i, x, cfg, states):
    f1 = block(sd, i, x, cfg) - x
    f2 = block(sd, i, x + f1 / 2, cfg) - (x + f1 / 2)
    f3 = block(sd, i, x + f2 / 2, cfg) - (x + f2 / 2)
    f4 = block(sd, i, x + f3, cfg) - (x + f3)
    return x + (f1 + 2 * f2 + 2 * f3 + f4) / 6


def layer_pcformer(sd, i, x, cfg, states, stages):
    eps, a = cfg["hist_eps"], sd["model.alpha"][0]
    R = [lambda t, j=j: layer_norm(sd, f"model.RK_norm.{j}", t, eps) for j in range(stages)]
    if stages == 2:
        o1 = R[0](block(sd, i, x, cfg))
        o2 = R[1](block(sd, i, x + o1, cfg))
        predictor = x + a * (1 - a) * o1 + a * o2
    else:
        o1 = R[0](block(sd, i, x, cfg))
        o2 = R[1](block(sd, i, x + o1 / 2, cfg))
        o3 = R[2](block(sd, i, x + o2 / 2, cfg))
        o4 = R[3](block(sd, i, x + o3, cfg))
        predictor = x + a * (1 - a) ** 3 * o1 + a * (1 - a) ** 2 * o2 + a * (1 - a) * o3 + a * o4
    l = i + 1
    states.append(layer_norm(sd, f"model.history.rouge_predictions_norm.{i}", predictor, eps))
    c = history_mix(sd["model.history.weight"], l, states)
    states[l] = layer_norm(sd, f"model.history.layer_norms.{i}", block(sd, i, c, cfg), eps)
    return history_mix(sd["model.history.weight_c"], l, states)


def layer_iiet_history(sd, i, x, cfg, states):
    """Spec 5b."""
    eps, l = cfg["hist_eps"], i + 1
    states.append(layer_norm(sd, f"model.history.rouge_predictions_norm.{i}", block(sd, i, x, cfg), eps))
    for _ in range(cfg["iterations"][i]):
        z = block(sd, i, history_mix(sd["model.history.weight"], l, states), cfg)
        states[l] = layer_norm(sd, f"model.history.layer_norms.{i}", z, eps)
    return history_mix(sd["model.history.weight_c"], l, states)


def layer_iiet_fixed_point(sd, i, x, cfg, states):
    """Spec 5a: y_0 = x + F(x), y_k = x + F(y_{k-1})."""
    y = x + (block(sd, i, x, cfg) - x)
    for _ in range(cfg["iterations"][i]):
        y = x + (block(sd, i, y, cfg) - y)
    return y


LAYER_FUNCTIONS = {
    "vanilla": layer_vanilla,
    "ode_rk2": layer_rk2,
    "ode_rk2_gated": lambda *a: layer_rk2(*a, gated=True),
    "ode_rk4": layer_rk4,
    "pcformer_rk2": lambda *a: layer_pcformer(*a, stages=2),
    "pcformer_rk4": lambda *a: layer_pcformer(*a, stages=4),
    "iiet/history": layer_iiet_history,
    "iiet/fixed_point": layer_iiet_fixed_point,
}


def reference_cfg(config):
    """The numbers the reference needs, read off an IIETConfig."""
    return {
        "hidden": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "layers": config.num_hidden_layers,
        "theta": config.rope_theta,
        "rms_eps": config.rms_norm_eps,
        "hist_eps": config.history_norm_eps,
        "iterations": list(config.iterations),
        "arch": config.architecture if config.architecture != "iiet" else f"iiet/{config.formulation}",
    }


@torch.no_grad()
def reference_logits(sd, cfg, input_ids):
    sd = {k: v.float() for k, v in sd.items()}
    x = sd["model.embed_tokens.weight"][input_ids]
    states = [x]
    layer_fn = LAYER_FUNCTIONS[cfg["arch"]]
    for i in range(cfg["layers"]):
        x = layer_fn(sd, i, x, cfg, states)
    x = rms_norm(x, sd["model.norm.weight"], cfg["rms_eps"])
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return x @ head.T
