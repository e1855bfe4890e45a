"""Bad input gets one clear error naming the problem, and nothing is written or lost."""

import json
import shutil

import pytest

from megatron_iiet.hf.convert import ConversionError, export_to_hf, find_checkpoint, import_from_hf
from tests.convert.conftest import assert_refused, copy_checkpoint, run_cli

pytestmark = pytest.mark.distributed  # uses the spawned checkpoint fixtures


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="not a megatron checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(ConversionError, match="does not exist"):
        find_checkpoint(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="not a directory"):
        find_checkpoint(tmp_path / "file")
    (tmp_path / "latest").write_text("iter_0000009")
    with pytest.raises(ConversionError, match="not a complete checkpoint"):
        find_checkpoint(tmp_path)


def test_broken_meta(checkpoints, tmp_path):
    root = copy_checkpoint(checkpoints, "vanilla-tp1", tmp_path)
    meta = root / "iter_0000007" / "meta.json"
    meta.write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        export_to_hf(root, tmp_path / "out")
    meta.write_text(json.dumps({"step": 1}))
    with pytest.raises(ConversionError, match="not written by this project's trainer"):
        export_to_hf(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_architecture_mismatch(checkpoints, tmp_path):
    root = checkpoints[0]
    with pytest.raises(ConversionError, match="holds a pcformer_rk2 model, expected iiet"):
        export_to_hf(root / "pcformer_rk2-tp2", tmp_path / "out", expect_architecture="iiet")
    assert not (tmp_path / "out").exists()


def test_missing_shard(checkpoints, tmp_path):
    root = copy_checkpoint(checkpoints, "ode_rk2-tp2", tmp_path)
    shard = sorted((root / "iter_0000007").glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises(ConversionError, match=f"missing checkpoint shards: {shard.name}"):
        export_to_hf(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_kept_without_force(checkpoints, tmp_path):
    root = checkpoints[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="exists; pass --force"):
        export_to_hf(root / "vanilla-tp1", out)
    assert (out / "precious.txt").read_text() == "keep me"


def test_bad_hf_folders(converted, tmp_path):
    with pytest.raises(ConversionError, match="no config.json"):
        import_from_hf(tmp_path, tmp_path / "out")
    folder = shutil.copytree(converted / "hf" / "vanilla-tp1", tmp_path / "sharded")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConversionError, match="missing: model-00002-of-00002.safetensors"):
        import_from_hf(folder, tmp_path / "out")
    source = converted / "hf" / "pcformer_rk2-tp1"
    with pytest.raises(ConversionError, match="PP=3 does not divide the 4 layers"):
        import_from_hf(source, tmp_path / "out", pp=3)
    with pytest.raises(ConversionError, match="holds a pcformer_rk2 model, expected iiet"):
        import_from_hf(source, tmp_path / "out", expect_architecture="iiet")
    assert not (tmp_path / "out").exists()


def test_cli_exits_2_with_one_line(converted, tmp_path):
    assert_refused(run_cli("megatron-to-hf", tmp_path, tmp_path / "out"),
                   tmp_path, "not a megatron checkpoint")
    assert_refused(run_cli("hf-to-megatron", converted / "hf" / "pcformer_rk4-pp2",
                           tmp_path / "out", "--tp", "2", "--pp", "3"),
                   "PP=3 does not divide the 4 layers")
    assert not (tmp_path / "out").exists()
