"""What transformers users do with an export besides generating: the base model through
AutoModel (registered, and from the folder's own code), fine-tuning with gradient
checkpointing, and loading in bf16."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from hf_helpers import export, tiny_model

IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 8, 1]])
ARCHITECTURES = [dict(architecture="iiet"), dict(architecture="pcformer_rk2"),
                 dict(architecture="vanilla")]


def test_auto_model_loads_the_base_model_registered_and_from_the_folder(tmp_path):
    import megatron_iiet.hf  # noqa: F401  (registers the classes)

    model, folder = export(tmp_path, seed=3, architecture="iiet")
    base = AutoModel.from_pretrained(folder).eval()
    assert type(base).__name__ == "IIETModel"
    with torch.no_grad():
        expected = model.model(IDS).last_hidden_state
        assert torch.equal(base(IDS).last_hidden_state, expected)
    child = textwrap.dedent("""
        import sys, torch
        from transformers import AutoModel
        model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        assert "megatron_iiet" not in sys.modules
        with torch.no_grad():
            torch.save(model(torch.tensor(%r)).last_hidden_state, sys.argv[2])
        """ % (IDS.tolist(),))
    (tmp_path / "child.py").write_text(child)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "child.py", str(folder), "out.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (torch.load(tmp_path / "out.pt") - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a["architecture"])
def test_gradient_checkpointing_gives_the_same_gradients(arch):
    plain = tiny_model(seed=5, **arch).train()
    checkpointed = tiny_model(seed=5, **arch).train()
    checkpointed.gradient_checkpointing_enable()
    assert checkpointed.model.gradient_checkpointing and checkpointed.is_gradient_checkpointing
    grads = []
    for model in (plain, checkpointed):
        model(IDS, labels=IDS).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6, rtol=1e-5), name


def test_gradient_checkpointing_recomputes_the_passes():
    """It must actually save memory: the block passes run again in the backward."""
    model = tiny_model(seed=5, architecture="iiet").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    # a pre-hook: the recompute stops early once the saved tensors are back (torch's
    # checkpoint early stop), before a post-hook on the pass's last module would fire
    mlp = model.model.layers[0].mlp  # runs once per pass of the layer
    handle = mlp.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss = model(IDS, labels=IDS).loss
    forward_calls = len(calls)
    loss.backward()
    handle.remove()
    assert forward_calls == 4  # r=3: predictor + 3 corrector passes
    assert len(calls) == 2 * forward_calls


@pytest.mark.parametrize("arch", ARCHITECTURES[:2], ids=lambda a: a["architecture"])
def test_bf16_load_casts_every_parameter(tmp_path, arch):
    import megatron_iiet.hf  # noqa: F401

    model, folder = export(tmp_path, seed=3, **arch)
    half = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    dtypes = {n: p.dtype for n, p in half.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}, {n: d for n, d in dtypes.items()
                                                       if d != torch.bfloat16}
    with torch.no_grad():
        full, low = model(IDS).logits, half(IDS).logits.float()
    assert (full - low).abs().max().item() < 0.1 * full.abs().max().item()
