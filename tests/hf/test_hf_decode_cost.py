"""Issue 12: cached decoding whose per-token cost follows the passes, without changing results.

The decode step does nothing per pass beyond the pass itself and O(1) history kernels: the
(layer, pass) stores grow in place (`IIETCacheLayer`), the history keeps per-layer partial sums
(`LayerHistory`), RoPE rows and the mask are prepared once per forward. These tests pin both
halves: the results (tokens and logits as without the cache, the rewritten pieces equal to the
plain formulas) and the structure (which kernels a decode step runs).
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_helpers import tiny_model
from megatron_iiet.hf import IIETCache
from megatron_iiet.hf import modeling_iiet as M

DECODE_CASES = [
    ("vanilla", dict(architecture="vanilla")),
    ("iiet_r3", dict(architecture="iiet", iterations=3)),
    ("eiiet_plan", dict(architecture="iiet", iterations=[3, 2, 1, 0])),
    ("pcformer_rk2", dict(architecture="pcformer_rk2")),
]
NEW_TOKENS = 12


def prompt(seed=0, batch=2, seq=6):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def small_blocks(monkeypatch):
    """Stores grow every few tokens, so a short decode exercises growth with copying."""
    monkeypatch.setattr(M.IIETCacheLayer, "BLOCK", 4)


@pytest.mark.parametrize("case,extra", DECODE_CASES, ids=[c for c, _ in DECODE_CASES])
@torch.no_grad()
def test_cached_decode_equals_use_cache_false(case, extra, small_blocks):
    """Greedy generate with the cache: the tokens and (to 1e-5) the logits of generate without it."""
    model = tiny_model(seed=11, **extra)
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    cached = model.generate(prompt(), use_cache=True, **kwargs)
    uncached = model.generate(prompt(), use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(cached.logits, uncached.logits))
    assert worst < 1e-5
    assert (uncached.logits[0] - uncached.logits[-1]).abs().max() > 1e-2  # the context matters


@torch.no_grad()
def test_store_grows_in_place_and_keeps_what_it_handed_out(small_blocks):
    layer = M.IIETCacheLayer()
    chunks = [torch.randn(2, 3, n, 5) for n in (3, 1, 1, 4, 1)]
    handed_out = []
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        handed_out.append((keys, torch.cat(chunks[: i + 1], dim=-2)))
    everything = torch.cat(chunks, dim=-2)
    assert layer.get_seq_length() == 10
    assert torch.equal(layer.keys, everything) and torch.equal(layer.values, -everything)
    assert layer._buffers[0].shape[-2] >= 10 and layer._buffers[0].shape[-2] % 4 == 0
    # Views handed out earlier still hold what they held (later writes go past their end).
    assert all(torch.equal(keys, want) for keys, want in handed_out)


@torch.no_grad()
def test_store_supports_the_cache_api(small_blocks):
    layer = M.IIETCacheLayer()
    data = torch.randn(3, 2, 6, 4)
    layer.update(data, data + 1)
    layer.crop(-2)  # transformers' crop: drop the last 2 positions
    assert layer.get_seq_length() == 4 and torch.equal(layer.keys, data[..., :4, :])
    layer.update(data[..., :1, :], data[..., :1, :] + 1)  # the next write goes after the crop
    assert torch.equal(layer.keys[..., 4:, :], data[..., :1, :])
    layer.reorder_cache(torch.tensor([2, 0, 1]))  # beam search
    assert torch.equal(layer.values[0, ..., :4, :], data[2, ..., :4, :] + 1)
    layer.batch_select_indices(torch.tensor([1, 2]))
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape == (4, 2, 5, 4)
    assert torch.equal(layer.keys[0, ..., :4, :], data[0, ..., :4, :])
    more = torch.randn(4, 2, 1, 4)
    layer.update(more, more)
    assert torch.equal(layer.keys[..., 5:, :], more)
    assert layer.get_seq_length() == 6
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None
    layer.update(data, data)
    assert torch.equal(layer.keys, data)
    with pytest.raises(ValueError, match="cannot take new ones"):
        layer.update(data[:1], data[:1])


@torch.no_grad()
def test_history_partial_sums_equal_the_plain_sums():
    """pop(l) / finish(l) from the per-layer partial sums equal sum_k W[l,k] S_k term by term."""
    model = tiny_model(seed=12, architecture="iiet", iterations=2)
    history = model.model.history
    gen = torch.Generator().manual_seed(0)
    states = history.start(torch.randn(2, 5, 64, generator=gen))
    for i in range(4):
        layer = history.layer(states, i)
        for _ in range(2):
            newest = torch.randn(2, 5, 64, generator=gen)
            plain = sum(history.weight[i + 1, k] * states[k] for k in range(i + 1))
            plain = plain + history.weight[i + 1, i + 1] * newest
            assert (layer.pop(newest) - plain).abs().max().item() < 1e-6
        final = torch.randn(2, 5, 64, generator=gen)
        refined = layer.finish(final)
        plain = sum(history.weight_c[i + 1, k] * states[k] for k in range(i + 2))
        assert torch.equal(states[i + 1], final)
        assert (refined - plain).abs().max().item() < 1e-6
    with pytest.raises(RuntimeError, match="layer 1 expects 2"):
        history.layer(history.start(states[0]), 1)


@torch.no_grad()
def test_history_gives_every_position_the_same_result_alone_or_in_a_sequence():
    """The partial-sum math for one position does not depend on how many positions run."""
    model = tiny_model(seed=13, architecture="iiet", iterations=[3, 2, 1, 0])
    history = model.model.history
    gen = torch.Generator().manual_seed(1)
    seq = [torch.randn(1, 7, 64, generator=gen) for _ in range(5)]
    full = history.layer(history.start(seq[0]), 0)
    alone = history.layer(history.start(seq[0][:, -1:]), 0)
    assert torch.equal(full.pop(seq[1])[:, -1:], alone.pop(seq[1][:, -1:]))
    assert torch.equal(full.finish(seq[2])[:, -1:], alone.finish(seq[2][:, -1:]))


def test_rope_and_norm_rewrites_are_bit_identical():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 7, 16, generator=gen)
    positions = torch.randint(0, 50, (2, 7), generator=gen)
    cos, sin = M.rope_tables(positions, 16, 10000.0, torch.float32)
    assert torch.equal(M.apply_rope_signed(x, cos, M.signed_sin(sin)), M.apply_rope(x, cos, sin))
    table = M.RopeTable()
    t_cos, t_sin = table.lookup(positions, 0, 7, 16, 10000.0, x.device, torch.float32)
    assert torch.equal(t_cos, cos) and torch.equal(t_sin, M.signed_sin(sin))
    s_cos, s_sin = table.lookup(None, 40, 3, 16, 10000.0, x.device, torch.float32)
    d_cos, d_sin = M.rope_tables(torch.arange(40, 43)[None], 16, 10000.0, torch.float32)
    assert torch.equal(s_cos, d_cos) and torch.equal(s_sin, M.signed_sin(d_sin))
    norm = M.IIETRMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(16, generator=gen))
    x32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(norm(x), norm.weight * x32)


@torch.no_grad()
def test_an_all_ones_attention_mask_is_no_mask():
    model = tiny_model(seed=14, architecture="iiet", iterations=[3, 0, 1, 2])
    tokens = prompt(seq=7)
    plain = model(tokens, use_cache=False).logits
    assert torch.equal(model(tokens, attention_mask=torch.ones_like(tokens), use_cache=False).logits, plain)
    with pytest.raises(ValueError, match="attention_mask covers 6 positions"):
        model(tokens, attention_mask=torch.ones_like(tokens)[:, 1:])


def top_level_ops(prof):
    """Names of the aten ops called from Python (not from inside another aten op)."""
    names = []
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            names.append(event.name)
    return names


@pytest.mark.parametrize("extra", [dict(iterations=3), dict(iterations=[3, 0, 1, 2])],
                         ids=["r3", "plan"])
@torch.no_grad()
def test_a_decode_step_does_constant_work_outside_the_passes(extra):
    """One cached decode step of IIET: no concatenation of the stores, one stack + one matmul per
    layer for the history's partial sums and one multiply-add per pop and per refine, a single
    LM head, and the same count of every op per pass (the mask and RoPE set-up are not per pass)."""
    model = tiny_model(seed=15, architecture="iiet", **extra)
    passes = model.config.passes_per_layer()
    layers, total = len(passes), sum(passes)
    tokens = prompt(batch=1, seq=5)
    cache = IIETCache(passes)
    model(tokens, cache=cache)
    mask = torch.ones(1, 6, dtype=torch.long)  # as generate passes it
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(tokens[:, :1], cache=cache, attention_mask=mask)
    ops = top_level_ops(prof)
    assert ops.count("aten::cat") == 0
    # + one stack per forward: W and Wc side by side
    assert ops.count("aten::stack") == layers + 1 and ops.count("aten::matmul") == layers
    pops = total - layers  # every pass but the predictor reads pop(l)
    assert ops.count("aten::addcmul") == pops + layers  # + one refine per layer
    assert ops.count("aten::linear") == 7 * total + 1  # q, k, v, o, gate, up, down + the LM head
    assert ops.count("aten::scaled_dot_product_attention") == total
    assert ops.count("aten::copy_") == 2 * total  # the new token's key and value, per slot
    assert len(ops) < 45 * total  # ~40 ops per pass; the old code ran ~68


def test_store_keeps_the_graph_of_earlier_steps_when_grad_flows():
    """With gradients on, the stores concatenate (no in-place write into saved tensors), so a
    backward through several cached steps works and matches the full forward's gradient."""
    model = tiny_model(seed=16, architecture="iiet", iterations=[2, 0, 1, 1])
    tokens = prompt(batch=1, seq=6)
    cache = IIETCache(model.config.passes_per_layer())
    parts = [model(tokens[:, a:b], cache=cache, use_cache=True).logits for a, b in [(0, 4), (4, 5), (5, 6)]]
    torch.cat(parts, dim=1).square().sum().backward()
    cached_grad = model.model.history.weight.grad.clone()
    model.zero_grad()
    model(tokens, use_cache=False).logits.square().sum().backward()
    full_grad = model.model.history.weight.grad
    # relative to the gradient's scale (~1e2 here): fp32 rounding over different op orders
    assert (cached_grad - full_grad).abs().max().item() < 1e-5 * full_grad.abs().max().item()
