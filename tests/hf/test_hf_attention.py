"""attn_implementation: "sdpa" (default) and "eager" (explicit softmax, as transformers' eager
attention) compute the same model; anything else is refused rather than silently run as SDPA."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_helpers import ARCH_CASES, tiny_config, tiny_model
from megatron_iiet.hf import IIETCache, IIETForCausalLM

TOL = 1e-5
TOKENS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
# Row 0 is left-padded by 3 (positions then count its real tokens only).
PADDING = torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9])


def twins(seed=0, **extra):
    """The same weights run with SDPA and with eager attention."""
    sdpa = tiny_model(seed=seed, **extra)
    eager = tiny_model(seed=seed, **extra)
    eager.set_attn_implementation("eager")
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    return sdpa, eager


def worst(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case,extra", ARCH_CASES, ids=[c for c, _ in ARCH_CASES])
@torch.no_grad()
def test_eager_equals_sdpa(case, extra):
    sdpa, eager = twins(seed=1, **extra)
    assert worst(eager(TOKENS).logits, sdpa(TOKENS).logits) < TOL
    padded = dict(attention_mask=PADDING)
    assert worst(eager(TOKENS, **padded).logits, sdpa(TOKENS, **padded).logits) < TOL


@pytest.mark.parametrize("arch,extra", [("iiet", dict(iterations=[3, 0, 1, 2])),
                                        ("pcformer_rk4", {}),
                                        ("iiet", dict(num_key_value_heads=2))])
@torch.no_grad()
def test_eager_equals_sdpa_with_the_cache(arch, extra):
    """Chunked prefill, then token by token, on a padded batch: every (layer, pass) slot."""
    sdpa, eager = twins(seed=2, architecture=arch, **extra)
    results = []
    for model in (sdpa, eager):
        cache = IIETCache(model.config.passes_per_layer())
        logits = [model(TOKENS[:, a:b], attention_mask=PADDING[:, :b], cache=cache).logits
                  for a, b in [(0, 5), (5, 6), (6, 7), (7, 9)]]
        results.append(torch.cat(logits, dim=1))
    assert worst(*results) < TOL
    assert worst(results[1], eager(TOKENS, attention_mask=PADDING).logits) < 1e-4
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    a, b = sdpa.generate(TOKENS, **kwargs), eager.generate(TOKENS, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert max(worst(x, y) for x, y in zip(a.logits, b.logits)) < TOL


def attention_ops(model):
    """How often each attention kernel ran in one forward, from torch's profiler."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(TOKENS, attention_mask=PADDING)
    names = [e.name for e in prof.events()]
    return names.count("aten::scaled_dot_product_attention"), names.count("aten::softmax")


def test_eager_is_its_own_code_path():
    sdpa, eager = twins(seed=3, architecture="iiet", iterations=[3, 0, 1, 2])
    passes = sum(sdpa.config.passes_per_layer())  # one attention per (layer, pass)
    assert attention_ops(sdpa) == (passes, 0)
    assert attention_ops(eager) == (0, passes)
    eager.set_attn_implementation("sdpa")  # switching back after loading works too
    assert attention_ops(eager) == (passes, 0)


@torch.no_grad()
def test_eager_keeps_the_input_dtype():
    sdpa, eager = twins(seed=4, architecture="ode_rk2")
    low = eager.to(torch.bfloat16)
    logits = low(TOKENS).logits
    assert logits.dtype == torch.bfloat16
    assert worst(logits.float(), sdpa(TOKENS).logits) < 0.5  # bf16 rounding only


@torch.no_grad()
def test_from_pretrained_and_config_choose_eager(tmp_path):
    model = tiny_model(seed=5, architecture="pcformer_rk2")
    model.save_pretrained(tmp_path / "export")
    eager = IIETForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    assert attention_ops(eager)[0] == 0
    assert worst(eager(TOKENS).logits, model(TOKENS).logits) < TOL
    assert IIETForCausalLM(tiny_config(attn_implementation="eager")).config._attn_implementation == "eager"


@pytest.mark.parametrize("name", ["flash_attention_2", "flex_attention", "paged|eager"])
def test_unsupported_implementations_are_refused(tmp_path, name):
    model = tiny_model(seed=6, architecture="vanilla")
    model.save_pretrained(tmp_path / "export")
    message = f'attn_implementation="{name}" is not supported by IIET models'
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        IIETForCausalLM.from_pretrained(tmp_path / "export", attn_implementation=name)
    with pytest.raises(ValueError, match="is not supported by IIET models"):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == "sdpa"
    # An implementation set behind transformers' back is refused at the forward, not run as SDPA.
    model.config._attn_implementation_internal = name
    with pytest.raises(ValueError, match="is not supported by IIET models"):
        model(TOKENS)
