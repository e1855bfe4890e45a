"""The CLI end to end: an exported folder loads in a fresh process with AutoModelForCausalLM and
AutoTokenizer offline and generates; an HF folder written as a TP=2 megatron checkpoint comes
back identical and continues training in pretrain_iiet.py (fresh optimizer, step 0) with its
weights intact."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.convert.conftest import REPO, hf_state, run_cli
from tests.convert.workers import TOKENIZER_VOCAB, input_ids
from tests.training.conftest import base_overrides, check_ok, launch, records

pytestmark = pytest.mark.distributed

# Runs without the repository on sys.path: only the exported folder's own code can serve it.
CHILD = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, ids_file, out = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "megatron_iiet" not in sys.modules, "the export must not need megatron_iiet"
    with torch.no_grad():
        logits = model(torch.load(ids_file)).logits
    prompt = tokenizer("def main():", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    torch.save({"logits": logits, "prompt": prompt, "generated": generated,
                "text": tokenizer.decode(generated[0])}, out)
    """
)


def test_cli_export_loads_in_a_fresh_process(checkpoints, corpus, tmp_path):
    root, megatron_logits = checkpoints[0], checkpoints[1]
    folder = tmp_path / "export"
    proc = run_cli("megatron-to-hf", root / "iiet-history-tp2", folder, "--trim-vocab",
                   "--max-shard-size", "100KB", "--expect-architecture", "iiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"wrote {folder}") and "layout" in proc.stdout
    assert "loaded" in proc.stderr and "writing" in proc.stderr  # progress lines
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 100KB

    ids_file, out = tmp_path / "ids.pt", tmp_path / "child.pt"
    torch.save(input_ids(), ids_file)
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               OMP_NUM_THREADS="1")
    child = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(folder),
                            str(ids_file), str(out)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-3000:]
    result = torch.load(out)
    assert result["logits"].shape[-1] == TOKENIZER_VOCAB  # padding rows cut
    reference = megatron_logits[("iiet-history", "tp2")][..., :TOKENIZER_VOCAB]
    assert (result["logits"] - reference).abs().max().item() < 1e-4
    from megatron_iiet.data.tokenizer import Tokenizer

    sp = Tokenizer.from_path(corpus.tokenizer_model)
    assert result["prompt"][0].tolist() == sp.encode("def main():")
    assert result["generated"].shape[1] == result["prompt"].shape[1] + 5


def test_hf_to_tp2_megatron_round_trip(checkpoints, converted, hf_source):
    """An HF folder made by the HF model itself -> TP=2 checkpoint (written by the 2 ranks of
    a TP=2 job) -> HF: identical tensors and config."""
    meg = checkpoints[2]
    meta = json.loads((meg / "iter_0000000" / "meta.json").read_text())
    assert meta["layout"]["tensor"] == 2 and meta["model_only"] is True and meta["step"] == 0
    writers = {f.name.split("_")[2] for f in (meg / "iter_0000000").glob("__*.distcp")}
    assert writers == {"0", "1"}  # files named __<rank>_<thread>: both ranks wrote shards
    a, b = hf_state(hf_source), hf_state(converted / "back" / "hf_to_tp2")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    config_a = json.loads((hf_source / "config.json").read_text())
    config_b = json.loads((converted / "back" / "hf_to_tp2" / "config.json").read_text())
    for key in ("architecture", "iterations", "max_iterations", "tie_word_embeddings",
                "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config_a[key] == config_b[key], key


def test_tp2_conversion_continues_training(checkpoints, converted, corpus, tmp_path):
    """pretrain_iiet.py (TP=1) starts from the TP=2 model-only checkpoint: weights restored,
    fresh optimizer, step 0. With lr 1e-30 the optimizer steps but no weight can move, so the
    trainer's final parameter digest must equal the converted checkpoint's."""
    meg = checkpoints[2]
    meta = json.loads((meg / "iter_0000000" / "meta.json").read_text())
    assert meta["tokenizer_fingerprint"] == corpus.fingerprint
    run = tmp_path / "run"
    overrides = base_overrides(corpus, run, **{
        "model.architecture": "iiet", "model.iterations": [3, 1, 0, 2],
        "model.share_embeddings_and_output_weights": False,
        "optimizer.lr": "1.0e-30", "optimizer.min_lr": 0.0, "schedule.train_steps": 2,
        "schedule.warmup_steps": 1, "checkpoint.load": str(meg),
        "checkpoint.dir": str(run / "checkpoints"), "eval.steps": 1,
        # relative to the directory launch() trains in: meta.json must store it resolved
        "data.tokenizer": os.path.relpath(corpus.tokenizer_model, REPO)})
    check_ok(launch(overrides, nproc=1))  # a lone process picks a free port itself
    resumed = records(run, "resume")
    assert resumed and resumed[0]["step"] == 0
    assert [r["step"] for r in records(run, "train")] == [1, 2]
    end = records(run, "end")[-1]
    assert end["step"] == 2 and end["params_sha256"] == (converted / "digest.txt").read_text()
    saved = json.loads((run / "checkpoints" / "iter_0000002" / "meta.json").read_text())
    assert saved["tokenizer"] == str(Path(corpus.tokenizer_model).resolve())


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_dtype_is_the_fp32_export_cast(checkpoints, tmp_path, dtype, torch_dtype):
    source = checkpoints[0] / "iiet-history-tp1"
    full, low = tmp_path / "fp32", tmp_path / dtype
    for folder, flag in ((full, "fp32"), (low, dtype)):
        proc = run_cli("megatron-to-hf", source, folder, "--dtype", flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
    reference, converted = hf_state(full), hf_state(low)
    assert set(reference) == set(converted)
    for name, tensor in converted.items():
        assert tensor.dtype == torch_dtype, name
        assert torch.equal(tensor, reference[name].to(torch_dtype)), name
