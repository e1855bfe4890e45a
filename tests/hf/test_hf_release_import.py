"""Importing a folder in the authors' released layout (LlamaConfig + extra tensors)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_helpers import tiny_model, weights
from hf_spec_reference import reference_logits
from megatron_iiet.hf import IIETForCausalLM
from megatron_iiet.hf.release_import import ReleaseImportError, import_release

L, D, H, FFN, V = 4, 64, 4, 96, 128
TOKENS = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))


def release_tensors(kind="iiet", tied=True, seed=0):
    """Random tensors under the release's names, built from the naming list alone."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    t = {"model.embed_tokens.weight": rnd(V, D), "model.norm.weight": 1 + rnd(D, scale=0.2)}
    for i in range(L):
        p = f"model.layers.{i}."
        for proj in "qkvo":
            t[p + f"self_attn.{proj}_proj.weight"] = rnd(D, D)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = rnd(FFN, D), rnd(FFN, D)
        t[p + "mlp.down_proj.weight"] = rnd(D, FFN)
        t[p + "input_layernorm.weight"] = 1 + rnd(D, scale=0.2)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(D, scale=0.2)
    if not tied:
        t["lm_head.weight"] = rnd(V, D)
    if kind in ("iiet", "pcformer"):
        for name in ("weight", "weight_c"):
            mix = torch.tril(torch.rand(L + 1, L + 1, generator=g) + 0.2)
            t[f"model.history.{name}"] = mix / mix.sum(-1, keepdim=True)
        for i in range(L):
            for norm in ("layer_norms", "rouge_predictions_norm"):
                t[f"model.history.{norm}.{i}.weight"] = 1 + rnd(D, scale=0.2)
                t[f"model.history.{norm}.{i}.bias"] = rnd(D, scale=0.1)
    if kind == "pcformer":
        t["model.alpha"] = torch.tensor([0.37])
        for j in range(2):
            t[f"model.RK_norm.{j}.weight"] = 1 + rnd(D, scale=0.2)
            t[f"model.RK_norm.{j}.bias"] = rnd(D, scale=0.1)
    return t


def llama_config(tied=True):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
        "intermediate_size": FFN, "num_hidden_layers": L, "num_attention_heads": H,
        "num_key_value_heads": H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": V,
        "tie_word_embeddings": tied, "max_position_embeddings": 256, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }


def write_release(folder, tensors, fmt="safetensors", shards=1, tied=True):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(llama_config(tied)))
    names = sorted(tensors)
    groups = [names[k::shards] for k in range(shards)]
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"{stem}.{ext}" if shards == 1 else f"{stem}-{k + 1:05d}-of-{shards:05d}.{ext}"
        part = {n: tensors[n].contiguous() for n in group}
        if fmt == "safetensors":
            save_file(part, str(folder / file))
        else:
            torch.save(part, folder / file)
        weight_map.update({n: file for n in group})
    if shards > 1:
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def spec_cfg(arch, iterations=(3, 3, 3, 3)):
    return {"hidden": D, "heads": H, "kv_heads": H, "layers": L, "theta": 1e4, "rms_eps": 1e-6,
            "hist_eps": 1e-5, "iterations": list(iterations), "arch": arch}


def imported_logits(folder):
    model = IIETForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model, model(TOKENS).logits


@pytest.mark.parametrize("fmt,shards", [("safetensors", 1), ("safetensors", 3), ("bin", 1), ("bin", 2)])
def test_iiet_release_imports_to_spec_5b(tmp_path, fmt, shards):
    tensors = release_tensors("iiet")
    src = write_release(tmp_path / "release", tensors, fmt, shards)
    (src / "tokenizer.model").write_bytes(b"sentencepiece stand-in")
    out = import_release(src, tmp_path / "out")
    model, got = imported_logits(out)
    assert model.config.architecture == "iiet" and model.config.formulation == "history"
    assert model.config.iterations == [3, 3, 3, 3]
    want = reference_logits(tensors, spec_cfg("iiet/history"), TOKENS)
    assert (got - want).abs().max().item() < 1e-4
    assert (out / "tokenizer.model").read_bytes() == b"sentencepiece stand-in"
    assert (out / "modeling_iiet.py").is_file()


def test_iterations_override_and_untied_head(tmp_path):
    tensors = release_tensors("iiet", tied=False, seed=1)
    src = write_release(tmp_path / "release", tensors, tied=False)
    out = import_release(src, tmp_path / "out", iterations=[2, 0, 1, 3])
    model, got = imported_logits(out)
    assert model.config.tie_word_embeddings is False
    want = reference_logits(tensors, spec_cfg("iiet/history", [2, 0, 1, 3]), TOKENS)
    assert (got - want).abs().max().item() < 1e-4


def test_pcformer_release_is_detected(tmp_path):
    tensors = release_tensors("pcformer", seed=2)
    out = import_release(write_release(tmp_path / "release", tensors), tmp_path / "out")
    model, got = imported_logits(out)
    assert model.config.architecture == "pcformer_rk2"
    want = reference_logits(tensors, spec_cfg("pcformer_rk2"), TOKENS)
    assert (got - want).abs().max().item() < 1e-4


def test_cli_runs_and_respects_force(tmp_path):
    cli = load_cli()
    src = write_release(tmp_path / "release", release_tensors("iiet"))
    out = tmp_path / "out"
    assert cli.main([str(src), str(out), "--iterations", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["iterations"] == [1, 1, 1, 1]
    with pytest.raises(SystemExit) as refused:  # exists, no --force
        cli.main([str(src), str(out), "--iterations", "2"])
    assert refused.value.code == 2
    assert json.loads((out / "config.json").read_text())["iterations"] == [1, 1, 1, 1]
    assert cli.main([str(src), str(out), "--iterations", "3,2,1,0", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["iterations"] == [3, 2, 1, 0]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


# ---- bad input ------------------------------------------------------------------------------
def test_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReleaseImportError, match="no config.json"):
        import_release(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "empty" / "config.json").write_text('{"foo": 1}')
    with pytest.raises(ReleaseImportError, match="not a LlamaConfig"):
        import_release(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(ReleaseImportError, match="holds no weights"):
        import_release(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_shard(tmp_path):
    src = write_release(tmp_path / "release", release_tensors("iiet"), shards=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ReleaseImportError, match="model-00002-of-00003.safetensors"):
        import_release(src, tmp_path / "out")


def test_shape_mismatch_names_the_tensor(tmp_path):
    tensors = release_tensors("iiet")
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(FFN + 1, D)
    src = write_release(tmp_path / "release", tensors)
    with pytest.raises(ReleaseImportError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*\(97, 64\)"):
        import_release(src, tmp_path / "out")


def test_missing_and_unexpected_tensors(tmp_path):
    tensors = release_tensors("iiet")
    del tensors["model.history.layer_norms.1.bias"]
    src = write_release(tmp_path / "a", tensors)
    with pytest.raises(ReleaseImportError, match=r"missing tensors.*layer_norms\.1\.bias"):
        import_release(src, tmp_path / "out")
    tensors = release_tensors("iiet")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    src = write_release(tmp_path / "b", tensors)
    with pytest.raises(ReleaseImportError, match=r"unexpected tensors.*mystery"):
        import_release(src, tmp_path / "out")


def test_tied_release_with_a_stored_head(tmp_path):
    tensors = release_tensors("iiet")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    out = import_release(write_release(tmp_path / "same", tensors), tmp_path / "out")
    assert IIETForCausalLM.from_pretrained(out).config.tie_word_embeddings
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ReleaseImportError, match="lm_head.weight differs"):
        import_release(write_release(tmp_path / "differs", tensors), tmp_path / "out2")


def test_iterations_rejected_for_pcformer(tmp_path):
    src = write_release(tmp_path / "release", release_tensors("pcformer"))
    with pytest.raises(ReleaseImportError, match="only apply to IIET"):
        import_release(src, tmp_path / "out", iterations=2)


# ---- architectures the tensors cannot tell apart ----------------------------------------------
def release_of(model, folder):
    """`model`'s weights in the release layout: a plain LlamaConfig, which names no architecture."""
    return write_release(folder, weights(model), tied=model.config.tie_word_embeddings)


def load_cli():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "import_release_cli", Path(__file__).resolve().parents[2] / "tools" / "import_release.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


@pytest.mark.parametrize("arch", ["ode_rk2", "ode_rk4"])
def test_ode_release_needs_its_architecture(tmp_path, capsys, arch):
    """An ODE model's tensors are a plain LLaMA's: guessing vanilla would give other logits, so
    the import is refused until --architecture names it, and then matches the source."""
    source = tiny_model(seed=12, architecture=arch)
    src = release_of(source, tmp_path / "release")
    cli, out = load_cli(), tmp_path / "out"
    with pytest.raises(SystemExit) as refused:
        cli.main([str(src), str(out)])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "vanilla, ode_rk2, ode_rk4" in lines[0] and "--architecture" in lines[0]
    assert not out.exists()

    assert cli.main([str(src), str(out), "--architecture", arch]) == 0
    model, got = imported_logits(out)
    assert model.config.architecture == arch
    with torch.no_grad():
        want = source(TOKENS).logits
    assert (got - want).abs().max().item() < 1e-5
    # The guess refused above would have loaded without complaint, and been wrong.
    vanilla = import_release(src, tmp_path / "vanilla", architecture="vanilla")
    assert (imported_logits(vanilla)[1] - want).abs().max().item() > 1e-2


def test_architecture_must_fit_the_tensors(tmp_path):
    plain = release_of(tiny_model(seed=13, architecture="ode_rk2"), tmp_path / "plain")
    for wrong in ("iiet", "ode_rk2_gated", "pcformer_rk2"):
        with pytest.raises(ReleaseImportError, match=f"--architecture {wrong} does not fit the "
                                                     "tensors.*vanilla or ode_rk2 or ode_rk4"):
            import_release(plain, tmp_path / "out", architecture=wrong)
    gated_source = tiny_model(seed=14, architecture="ode_rk2_gated")
    gated = release_of(gated_source, tmp_path / "gated")
    with pytest.raises(ReleaseImportError, match="--architecture ode_rk2 does not fit.*ode_rk2_gated"):
        import_release(gated, tmp_path / "out", architecture="ode_rk2")
    history = write_release(tmp_path / "history", release_tensors("iiet"))
    with pytest.raises(ReleaseImportError, match="--architecture vanilla does not fit.*those of iiet$"):
        import_release(history, tmp_path / "out", architecture="vanilla")
    assert not (tmp_path / "out").exists()
    # Gate tensors fit one architecture only: no --architecture needed.
    model, got = imported_logits(import_release(gated, tmp_path / "out"))
    assert model.config.architecture == "ode_rk2_gated"
    with torch.no_grad():
        assert (got - gated_source(TOKENS).logits).abs().max().item() < 1e-5


def test_a_config_naming_the_architecture_settles_it(tmp_path):
    """A folder of ours (IIETConfig names `architecture`) needs no flag; a flag contradicting
    its config is refused."""
    source = tiny_model(seed=15, architecture="ode_rk4")
    source.save_pretrained(tmp_path / "ours")
    model, got = imported_logits(import_release(tmp_path / "ours", tmp_path / "out"))
    assert model.config.architecture == "ode_rk4"
    with torch.no_grad():
        assert (got - source(TOKENS).logits).abs().max().item() < 1e-5
    with pytest.raises(ReleaseImportError, match="--architecture ode_rk2 contradicts .*config.json"
                                                 ", which names ode_rk4"):
        import_release(tmp_path / "ours", tmp_path / "out2", architecture="ode_rk2")


def test_hf_to_megatron_reads_an_ode_release_only_when_told(tmp_path):
    """`convert_checkpoint.py hf-to-megatron` on the release layout makes the same choice:
    refused without --expect-architecture, the named ODE model with it."""
    from megatron_iiet.hf.checks import ConversionError
    from megatron_iiet.hf.hf_to_megatron import read_hf_folder

    src = release_of(tiny_model(seed=16, architecture="ode_rk4"), tmp_path / "release")
    with pytest.raises(ConversionError, match="fit vanilla, ode_rk2, ode_rk4 alike.*pass "
                                              "--expect-architecture"):
        read_hf_folder(src)
    config, _ = read_hf_folder(src, architecture="ode_rk4")
    assert config.architecture == "ode_rk4"
