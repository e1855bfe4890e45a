"""Nothing lost under faults (issue 9): damaged or non-finite conversion inputs are refused by
tools/convert_checkpoint.py with exit 2 and one line naming the file (or tensor) at fault, and
nothing is left at the destination. Every case runs the real CLI on real, damaged files."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_iiet.training.checkpoint_meta import CheckpointMeta
from tests.convert.conftest import (assert_nothing_written, assert_refused, copy_checkpoint,
                                    hf_state, run_cli)

pytestmark = pytest.mark.distributed  # uses the spawned checkpoint fixtures

# hf_source's tensors poisoned below; the first is the first bad one in every order we report.
NAN_TENSOR = "model.layers.0.mlp.up_proj.weight"
INF_TENSOR = "model.norm.weight"
NAN_TENSOR_IN_MEGATRON = "decoder.layers.0.block.mlp.linear_fc1.weight"  # [gate; up]


def truncate_to_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def overwrite_with_random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(path.stat().st_size))


def copy_hf_folder(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "hf"))


def rewrite_weights(folder: Path, edit) -> None:
    """Apply `edit` to the state dict in folder/model.safetensors and write it back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- 9: NaN / Inf weights ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def nonfinite_hf(hf_source, tmp_path_factory):
    """hf_source with NaNs in one tensor and an Inf in another."""
    def poison(tensors):
        tensors[NAN_TENSOR][0, :3] = float("nan")
        tensors[INF_TENSOR][5] = float("inf")

    folder = copy_hf_folder(hf_source, tmp_path_factory.mktemp("nonfinite"))
    rewrite_weights(folder, poison)
    return folder


@pytest.fixture(scope="module")
def nonfinite_checkpoint(nonfinite_hf, tmp_path_factory):
    """nonfinite_hf converted with --allow-nonfinite: a megatron checkpoint whose weights hold
    NaN/Inf, as a diverged run's would."""
    root = tmp_path_factory.mktemp("nonfinite_ckpt") / "ckpt"
    proc = run_cli("hf-to-megatron", nonfinite_hf, root, "--allow-nonfinite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return root


def test_hf_to_megatron_refuses_nonfinite_weights(nonfinite_hf, tmp_path):
    line = assert_refused(run_cli("hf-to-megatron", nonfinite_hf, tmp_path / "out"),
                          nonfinite_hf, f"first: {NAN_TENSOR}", "--allow-nonfinite")
    assert "2 of " in line and "3 NaN and 0 Inf" in line
    assert_nothing_written(tmp_path / "out")


def test_megatron_to_hf_refuses_nonfinite_weights(nonfinite_checkpoint, tmp_path):
    # --quiet: the check needs the loaded tensors, i.e. runs after the first progress line.
    line = assert_refused(run_cli("megatron-to-hf", nonfinite_checkpoint, tmp_path / "out",
                                  "--quiet"),
                          nonfinite_checkpoint / "iter_0000000",
                          f"first: {NAN_TENSOR_IN_MEGATRON}", "--allow-nonfinite")
    assert "2 of " in line
    assert_nothing_written(tmp_path / "out")


def test_allow_nonfinite_converts_both_ways_unchanged(nonfinite_hf, nonfinite_checkpoint,
                                                      tmp_path):
    out = tmp_path / "out"
    proc = run_cli("megatron-to-hf", nonfinite_checkpoint, out, "--allow-nonfinite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    source, back = hf_state(nonfinite_hf), hf_state(out)
    assert set(source) == set(back)
    for name, tensor in source.items():  # every NaN and Inf made it through, where it was
        assert torch.equal(tensor.isnan(), back[name].isnan()), name
        assert torch.equal(tensor.isinf(), back[name].isinf()), name
    assert back[NAN_TENSOR].isnan().sum() == 3 and back[INF_TENSOR].isinf().sum() == 1


def test_values_beyond_the_output_dtype_are_refused(hf_source, tmp_path):
    def too_large_for_fp16(tensors):
        tensors[NAN_TENSOR][1, 1] = 1e6  # fp16 tops out at 65504

    folder = copy_hf_folder(hf_source, tmp_path)
    rewrite_weights(folder, too_large_for_fp16)
    line = assert_refused(run_cli("hf-to-megatron", folder, tmp_path / "out", "--precision",
                                  "fp16"),
                          folder, f"first: {NAN_TENSOR}", "would become Inf in float16")
    assert "1 of " in line
    assert_nothing_written(tmp_path / "out")


# ---- 12: damaged or missing HF files ------------------------------------------------------------
@pytest.mark.parametrize("damage", [truncate_to_half, overwrite_with_random_bytes])
def test_corrupt_safetensors_is_refused_naming_the_file(hf_source, tmp_path, damage):
    folder = copy_hf_folder(hf_source, tmp_path)
    damage(folder / "model.safetensors")
    assert_refused(run_cli("hf-to-megatron", folder, tmp_path / "out"),
                   f"{folder / 'model.safetensors'}: not a valid safetensors file (")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("lost, says", [("model.safetensors", "holds no weights"),
                                        ("config.json", "no config.json")])
def test_missing_weights_or_config_is_refused_naming_the_folder(hf_source, tmp_path, lost,
                                                                says):
    folder = copy_hf_folder(hf_source, tmp_path)
    (folder / lost).unlink()
    assert_refused(run_cli("hf-to-megatron", folder, tmp_path / "out"), folder, says)
    assert_nothing_written(tmp_path / "out")


@pytest.fixture
def sharded_hf(hf_source, tmp_path):
    """hf_source re-saved by transformers in several safetensors shards with an index."""
    from megatron_iiet.hf import IIETForCausalLM

    folder = tmp_path / "sharded"
    IIETForCausalLM.from_pretrained(hf_source).save_pretrained(folder, max_shard_size="200KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    return folder


def test_sharded_export_with_a_lost_or_damaged_shard_is_refused(sharded_hf, tmp_path):
    index = sharded_hf / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    truncate_to_half(sharded_hf / shards[0])
    assert_refused(run_cli("hf-to-megatron", sharded_hf, tmp_path / "out"),
                   f"{sharded_hf / shards[0]}: not a valid safetensors file (")
    (sharded_hf / shards[-1]).unlink()
    assert_refused(run_cli("hf-to-megatron", sharded_hf, tmp_path / "out"),
                   index, f"missing: {shards[-1]}")
    truncate_to_half(index)
    assert_refused(run_cli("hf-to-megatron", sharded_hf, tmp_path / "out"),
                   f"{index} is not valid JSON")
    assert_nothing_written(tmp_path / "out")


# ---- 13: a damaged megatron checkpoint ----------------------------------------------------------
def invalid_json(path: Path) -> None:
    path.write_text('{"config": {not json')


@pytest.mark.parametrize("damage", [invalid_json, truncate_to_half, overwrite_with_random_bytes])
def test_broken_meta_json_is_refused_naming_the_file(checkpoints, tmp_path, damage):
    root = copy_checkpoint(checkpoints, "vanilla-tp1", tmp_path)
    meta = root / "iter_0000007" / "meta.json"
    damage(meta)
    assert_refused(run_cli("megatron-to-hf", root, tmp_path / "out"),
                   f"{meta}: not valid JSON (")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("content, found", [
    (bytes(range(256))[::-1] * 2, "512 bytes of binary data"),
    (b"iter_0000007\n\x1b[2J garbage\n", "'iter_0000007\\n\\x1b[2J garbage'"),
    (b"../vanilla-tp2/iter_0000007", "'../vanilla-tp2/iter_0000007'"),
    (b"", "an empty file"),
], ids=["binary", "two_lines", "path_out_of_the_root", "empty"])
def test_garbled_latest_pointer_is_refused_naming_the_file(checkpoints, tmp_path, content,
                                                          found):
    root = copy_checkpoint(checkpoints, "vanilla-tp1", tmp_path)
    (root / "latest").write_bytes(content)
    assert_refused(run_cli("megatron-to-hf", root, tmp_path / "out"),
                   f"{root / 'latest'}: not a checkpoint pointer", f"found {found})")
    assert_nothing_written(tmp_path / "out")


# ---- issue 28, case 6: a planted pickle is refused and does not run; case 14: an older
# checkpoint's legacy tokenizer fingerprint still exports --------------------------------------
def test_megatron_to_hf_refuses_a_planted_metadata_pickle_without_running_it(checkpoints,
                                                                              tmp_path):
    import pickle

    from tests.training.faults import Payload, forge_manifest

    root = copy_checkpoint(checkpoints, "vanilla-tp1", tmp_path)
    ckpt = root / "iter_0000007"
    marker = tmp_path / "payload-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    forge_manifest(ckpt)
    assert_refused(run_cli("megatron-to-hf", root, tmp_path / "out"),
                   f"{ckpt / '.metadata'}: refusing to unpickle it")
    assert not marker.exists(), "the planted code ran"
    assert_nothing_written(tmp_path / "out")


def test_a_checkpoint_with_the_legacy_tokenizer_fingerprint_exports(checkpoints, corpus, tmp_path):
    from megatron_iiet.data.tokenizer import Tokenizer
    from megatron_iiet.hf.megatron_to_hf import resolve_tokenizer

    root = copy_checkpoint(checkpoints, "vanilla-tp1", tmp_path)
    meta_file = root / "iter_0000007" / "meta.json"
    meta = json.loads(meta_file.read_text())
    tokenizer = Tokenizer.from_path(corpus.tokenizer_model)
    assert meta["tokenizer_fingerprint"] == tokenizer.fingerprint
    meta["tokenizer_fingerprint"] = tokenizer.legacy_fingerprint  # as versions before recorded
    meta_file.write_text(json.dumps(meta))
    proc = run_cli("megatron-to-hf", root, tmp_path / "out", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert Tokenizer.from_path(tmp_path / "out").fingerprint == tokenizer.fingerprint
    with pytest.raises(ValueError, match="is not the one the checkpoint was trained with"):
        resolve_tokenizer(CheckpointMeta.from_dict(
            {**meta, "tokenizer_fingerprint": "spm-sha256:another"}), None, meta_file.parent)


# ---- issue 28, one owner of the checkpoint contract: an imported checkpoint carries the same
# manifest and checksums as a trained one, so a change inside it is found at load --------------
def test_an_imported_checkpoint_is_integrity_checked_at_load(checkpoints, tmp_path):
    from megatron_iiet.training.checkpoint_index import manifest, read_meta

    root = Path(shutil.copytree(checkpoints[2], tmp_path / "imported"))  # imported by 2 ranks
    ckpt = root / "iter_0000000"
    meta = read_meta(ckpt)
    assert meta.model_only and meta.files == manifest(ckpt)
    assert sorted(meta.checksums["files"]) == sorted(meta.files)
    assert any(name.startswith("tokenizer/") for name in meta.files)
    shard = max(ckpt.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same name: only the checksum can tell
    shard.write_bytes(bytes(data))
    assert_refused(run_cli("megatron-to-hf", root, tmp_path / "out", "--quiet"),
                   f"{shard}: altered since it was saved")
    assert_nothing_written(tmp_path / "out")
