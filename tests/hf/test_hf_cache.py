"""Spec 5d: decoding with one KV cache per (layer, pass) equals recomputing the whole prefix."""

import pytest
import torch

from hf_helpers import ARCH_CASES, tiny_model
from megatron_iiet.hf import IIETCache

NEW_TOKENS = 8
TOL = 1e-4


def prompt(seed=0, batch=2, seq=6):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def recompute_greedy(model, tokens, steps):
    """Greedy decoding without any cache: each step runs the full prefix again."""
    logits = []
    for _ in range(steps):
        last = model(tokens, use_cache=False).logits[:, -1]
        logits.append(last)
        tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], dim=1)
    return tokens, logits


@pytest.mark.parametrize("case,extra", ARCH_CASES, ids=[c for c, _ in ARCH_CASES])
def test_cached_generate_equals_recompute(case, extra):
    model = tiny_model(seed=3, **extra)
    tokens = prompt()
    out = model.generate(
        tokens, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    want_tokens, want_logits = recompute_greedy(model, tokens, NEW_TOKENS)
    assert torch.equal(out.sequences, want_tokens)
    worst = max((a - b).abs().max().item() for a, b in zip(out.logits, want_logits))
    assert worst < TOL
    # Each step's prediction depends on the growing context, so the cache is exercised for real.
    assert (want_logits[0] - want_logits[-1]).abs().max() > 1e-2


def test_every_layer_pass_has_its_own_slot():
    model = tiny_model(seed=4, architecture="iiet", iterations=[3, 0, 1, 2])
    tokens = prompt(seq=5)
    with torch.no_grad():
        cache = model(tokens, use_cache=True).cache
    assert isinstance(cache, IIETCache)
    assert cache.passes_per_layer == [4, 1, 2, 3] and len(cache.layers) == 10
    assert all(layer.get_seq_length() == 5 for layer in cache.layers)
    # Passes of one layer see different inputs, hence store different keys.
    first, second = cache.layers[cache.slot(0, 0)].keys, cache.layers[cache.slot(0, 1)].keys
    assert (first - second).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["iiet", "pcformer_rk2"])
def test_chunked_prefill_equals_one_pass(arch):
    """Several new tokens on top of a cache (causal mask with an offset) match the full forward."""
    model = tiny_model(seed=5, architecture=arch)
    tokens = prompt(seq=11)
    with torch.no_grad():
        full = model(tokens, use_cache=False).logits
        cache = IIETCache(model.config.passes_per_layer())
        parts = [model(tokens[:, a:b], cache=cache).logits for a, b in [(0, 4), (4, 5), (5, 11)]]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < TOL


def test_left_padded_batch_matches_rows_alone():
    model = tiny_model(seed=6, architecture="iiet", iterations=[2, 1, 0, 3])
    short, long = prompt(seed=1, batch=1, seq=3), prompt(seed=2, batch=1, seq=6)
    pad = 0
    batch = torch.cat([torch.cat([torch.full((1, 3), pad), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=pad, output_logits=True,
                  return_dict_in_generate=True)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    for row, alone_prompt in enumerate([short, long]):
        alone = model.generate(alone_prompt, **kwargs)
        assert torch.equal(together.sequences[row, -5:], alone.sequences[0, -5:])
        worst = max((a[row] - b[0]).abs().max().item() for a, b in zip(together.logits, alone.logits))
        assert worst < TOL


def test_cache_refuses_a_changed_iteration_plan():
    model = tiny_model(seed=7, architecture="iiet", iterations=3)
    with torch.no_grad():
        cache = model(prompt(), use_cache=True).cache
    model.config.iterations = [1, 1, 1, 1]
    with pytest.raises(ValueError, match="changing `iterations`"):
        model(prompt()[:, :1], cache=cache)


def test_cache_refuses_a_foreign_non_empty_cache():
    from transformers import DynamicCache

    model = tiny_model(seed=8, architecture="vanilla")
    foreign = DynamicCache()
    foreign.update(torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, 16), 0)
    with pytest.raises(ValueError, match="IIETCache"):
        model(prompt()[:, :1], cache=foreign)


def test_beam_search_with_cache_equals_without():
    """Beam search reorders every (layer, pass) slot; the result must not depend on the cache."""
    model = tiny_model(seed=9, architecture="pcformer_rk2", tie_word_embeddings=False)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt(), use_cache=True, **kwargs)
    uncached = model.generate(prompt(), use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
