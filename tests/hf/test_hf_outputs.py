"""Output options as transformers models have them: `output_hidden_states` (embeddings, then each
layer's output, the last one after the final norm), `return_dict=False` tuples, and the config
defaults of both. A vanilla IIET model is a LLaMA, so transformers' own LlamaForCausalLM with the
same weights is the reference for what these options return."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_helpers import TINY, tiny_model, weights
from megatron_iiet.hf import IIETCache

TOKENS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def llama_twin(model):
    """transformers' LlamaForCausalLM holding the weights of a vanilla IIET model."""
    config = LlamaConfig(**TINY, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True)
    llama = LlamaForCausalLM(config).eval()
    missing, unexpected = llama.load_state_dict(weights(model), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    return llama


@torch.no_grad()
def test_hidden_states_are_llamas():
    model = tiny_model(seed=1, architecture="vanilla")
    llama = llama_twin(model)
    ours, theirs = model(TOKENS, output_hidden_states=True), llama(TOKENS, output_hidden_states=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == TINY["num_hidden_layers"] + 1
    for mine, reference in zip(ours.hidden_states, theirs.hidden_states):
        assert (mine - reference).abs().max().item() < 1e-5
    assert (ours.logits - theirs.logits).abs().max().item() < 1e-5
    # Selecting hidden states by index (transformers 5): the others come back as None.
    picked = model(TOKENS, output_hidden_states=[0, -1]).hidden_states
    wanted = llama(TOKENS, output_hidden_states=[0, -1]).hidden_states
    assert [h is None for h in picked] == [h is None for h in wanted] == [False, True, True, True, False]
    assert torch.equal(picked[0], ours.hidden_states[0]) and torch.equal(picked[-1], ours.hidden_states[-1])


@pytest.mark.parametrize("arch,extra", [("iiet", dict(iterations=[3, 0, 1, 2])), ("ode_rk4", {}),
                                        ("pcformer_rk2", {})])
@torch.no_grad()
def test_hidden_states_of_every_layer(arch, extra):
    """Embeddings, the output of each layer (its whole pass loop), the final-normed last one;
    IIETModel and IIETForCausalLM alike."""
    model = tiny_model(seed=2, architecture=arch, **extra)
    out = model(TOKENS, output_hidden_states=True, use_cache=False)
    base = model.model(TOKENS, output_hidden_states=True, use_cache=False)
    L = TINY["num_hidden_layers"]
    assert len(out.hidden_states) == len(base.hidden_states) == L + 1
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, base.hidden_states))
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(TOKENS))
    assert torch.equal(out.hidden_states[-1], base.last_hidden_state)
    assert torch.equal(model.lm_head(out.hidden_states[-1]), out.logits)
    # Entry k (0 < k < L) is layer k-1's raw output: the same model cut to its first k layers
    # ends in norm(entry k), and its own entries before that are the full model's.
    for k in range(1, L):
        cut = tiny_model(seed=2, architecture=arch, **extra)
        cut.model.layers = cut.model.layers[:k]
        cut.config.num_hidden_layers, cut.config.iterations = k, cut.config.iterations[:k]
        short = cut.model(TOKENS, output_hidden_states=True, use_cache=False)
        assert torch.equal(short.last_hidden_state, model.model.norm(out.hidden_states[k]))
        assert all(torch.equal(a, b) for a, b in zip(short.hidden_states[:k], out.hidden_states))
    assert model(TOKENS).hidden_states is None  # off by default (config.output_hidden_states)


@torch.no_grad()
def test_return_dict_false_gives_transformers_tuples():
    model = tiny_model(seed=3, architecture="vanilla")
    llama = llama_twin(model)
    for kwargs in (dict(), dict(labels=TOKENS), dict(output_hidden_states=True, labels=TOKENS),
                   dict(use_cache=False)):
        ours = model(TOKENS, return_dict=False, **kwargs)
        theirs = llama(TOKENS, return_dict=False, **kwargs)
        assert isinstance(ours, tuple) and len(ours) == len(theirs), kwargs
        for mine, reference in zip(ours, theirs):
            if isinstance(reference, torch.Tensor):
                assert (mine - reference).abs().max().item() < 1e-5, kwargs
            elif isinstance(reference, tuple):  # hidden states
                assert len(mine) == len(reference), kwargs
            else:  # the cache
                assert isinstance(mine, IIETCache), kwargs
        assert all(_same(a, b) for a, b in zip(ours, model(TOKENS, **kwargs).to_tuple()))
    with_loss = model(TOKENS, labels=TOKENS, return_dict=False)
    assert with_loss[0].dim() == 0 and with_loss[1].shape == (2, 7, TINY["vocab_size"])
    base = model.model(TOKENS, return_dict=False, use_cache=False)
    assert len(base) == 1 and torch.equal(base[0], model.model(TOKENS).last_hidden_state)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


@torch.no_grad()
def test_config_defaults_are_respected(tmp_path):
    model = tiny_model(seed=4, architecture="ode_rk2")
    model.config.output_hidden_states = True
    assert len(model(TOKENS).hidden_states) == TINY["num_hidden_layers"] + 1
    assert model(TOKENS, output_hidden_states=False).hidden_states is None
    model.config.output_hidden_states = False
    model.config.return_dict = False
    assert isinstance(model(TOKENS), tuple) and isinstance(model.model(TOKENS), tuple)
    assert not isinstance(model(TOKENS, return_dict=True), tuple)
    model.config.return_dict = True
    model.save_pretrained(tmp_path / "export")
    loaded = type(model).from_pretrained(tmp_path / "export", output_hidden_states=True,
                                         return_dict=False)
    out = loaded(TOKENS, use_cache=False)
    assert isinstance(out, tuple) and len(out) == 2 and len(out[1]) == TINY["num_hidden_layers"] + 1


def test_output_attentions_is_refused():
    model = tiny_model(seed=5, architecture="iiet")
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        model(TOKENS, output_attentions=True)


@torch.no_grad()
def test_generate_returns_hidden_states():
    model = tiny_model(seed=6, architecture="ode_rk2")
    out = model.generate(TOKENS, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         output_hidden_states=True, return_dict_in_generate=True)
    assert len(out.hidden_states) == 3
    assert all(len(step) == TINY["num_hidden_layers"] + 1 for step in out.hidden_states)
    assert out.hidden_states[0][0].shape == (2, 7, TINY["hidden_size"])  # prefill
    assert out.hidden_states[1][0].shape == (2, 1, TINY["hidden_size"])  # one cached step
