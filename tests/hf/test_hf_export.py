"""save_pretrained -> a folder that loads anywhere: remote code in a fresh process, or the
registered classes when megatron_iiet is importable."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import load_file

from hf_helpers import export, tiny_model
from megatron_iiet.hf import IIETForCausalLM

PROMPT = [[5, 17, 99, 3, 42, 7]]

# Runs in a fresh interpreter whose sys.path does not contain the repository, so the only code
# it can use is what the exported folder ships.
CHILD = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    folder, out = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert "megatron_iiet" not in sys.modules, "the export must not need megatron_iiet"
    ids = torch.tensor(%r)
    with torch.no_grad():
        logits = model(ids).logits
    gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    torch.save({"cls": type(model).__module__ + "." + type(model).__name__, "logits": logits,
                "sequences": gen.sequences, "step_logits": torch.stack(gen.logits)}, out)
    """
    % (PROMPT,)
)


def test_export_folder_layout(tmp_path):
    model, folder = export(tmp_path, architecture="iiet", iterations=[3, 0, 1, 2])
    files = set(os.listdir(folder))
    assert {"config.json", "configuration_iiet.py", "modeling_iiet.py", "cache_iiet.py", "model.safetensors"} <= files
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "iiet"
    assert config["iterations"] == [3, 0, 1, 2]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_iiet.IIETConfig",
        "AutoModel": "modeling_iiet.IIETModel",
        "AutoModelForCausalLM": "modeling_iiet.IIETForCausalLM",
    }
    saved = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in saved  # tied: the embedding serves as head
    assert saved["model.history.weight"].shape == (5, 5)
    assert set(saved) == set(model.state_dict()) - {"lm_head.weight"}


def test_fresh_process_loads_with_remote_code_offline(tmp_path):
    model, folder = export(tmp_path, architecture="pcformer_rk2", tie_word_embeddings=False)
    script, out = tmp_path / "child.py", tmp_path / "child.pt"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(folder), str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = torch.load(out)
    assert child["cls"].endswith("modeling_iiet.IIETForCausalLM")
    assert not child["cls"].startswith("megatron_iiet")
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        here = model(ids).logits
    assert (child["logits"] - here).abs().max().item() < 1e-5
    gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    assert torch.equal(child["sequences"], gen.sequences)
    assert (child["step_logits"] - torch.stack(gen.logits)).abs().max().item() < 1e-5


def test_registered_classes_load_without_remote_code(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model, folder = export(tmp_path, architecture="iiet", iterations=2)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is IIETForCausalLM
    assert AutoConfig.from_pretrained(folder).iterations == [2, 2, 2, 2]
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_loading_with_fewer_iterations(tmp_path):
    """An exported r=3 model runs an E-IIET plan by overriding the config at load time."""
    model, folder = export(tmp_path, architecture="iiet", iterations=3)
    pruned = IIETForCausalLM.from_pretrained(folder, iterations=[1, 0, 2, 3]).eval()
    assert pruned.config.passes_per_layer() == [2, 1, 3, 4]
    for name, tensor in model.state_dict().items():
        assert torch.equal(pruned.state_dict()[name], tensor), name


def test_fresh_init_follows_the_spec():
    model = IIETForCausalLM(tiny_model(architecture="pcformer_rk4").config)
    W = model.model.history.weight
    assert torch.allclose(W[3, :4], torch.full((4,), 0.25)) and torch.all(W[3, 4:] == 0)
    assert torch.equal(model.model.history.weight_c, W)
    assert model.model.alpha.item() == 0.5 and len(model.model.RK_norm) == 4
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
