"""The checkpoint contract (issue 28, "one owner"): meta.json read as a typed, versioned
CheckpointMeta, older checkpoints read with defaults, the architecture signature a declared list
of fields with defaults. Checkpoints on disk are exercised in test_checkpoint_faults.py and
tests/convert/test_corrupt_input.py; these tests need no process group."""

import dataclasses
import json

import pytest

from megatron_iiet.training import checkpoint_meta as cm
from megatron_iiet.training.checkpoint_index import CheckpointError, read_meta
from megatron_iiet.training.checkpointing import check_compatible
from megatron_iiet.training.config import build_model_config, load_config, padded_vocab_size

VOCAB = padded_vocab_size(500)


@pytest.fixture(scope="module")
def model_config():
    return build_model_config(load_config(None, ["model.preset=tiny"]), VOCAB)


def full_meta(model_config) -> cm.CheckpointMeta:
    """A checkpoint's metadata as this version writes it, every field set."""
    return cm.CheckpointMeta(
        step=8, consumed_samples=64, skipped_steps=1, version=cm.META_VERSION, engine="megatron",
        layout={"tensor": 1, "pipeline": 1, "data": 1}, scheduler={"num_steps": 8},
        model_only=False, config=load_config(None, ["model.preset=tiny"]).to_dict(),
        architecture=cm.architecture_signature(model_config), tokenizer="/t/tokenizer.model",
        tokenizer_fingerprint="spm-sha256:0", data_order="epoch_chunks",
        source={"hf_folder": "/hf"}, files={"common.pt": 10},
        checksums={"algorithm": "xxh3_128", "files": {"common.pt": "0" * 32}})


OPTIONAL = [f.name for f in dataclasses.fields(cm.CheckpointMeta) if f.name not in ("step", "extra")]


@pytest.mark.parametrize("dropped", OPTIONAL)
def test_an_older_meta_without_a_later_field_reads_with_its_default(model_config, tmp_path,
                                                                     dropped):
    saved = full_meta(model_config).to_dict()
    del saved[dropped]
    (tmp_path / "meta.json").write_text(json.dumps(saved))
    meta = read_meta(tmp_path)
    default = cm.CheckpointMeta(step=0)
    assert getattr(meta, dropped) == getattr(default, dropped)
    assert meta.step == 8 and meta.extra == {}


def test_keys_of_a_newer_version_are_kept_not_refused(model_config):
    saved = {**full_meta(model_config).to_dict(), "written_by_v9": {"x": 1}}
    meta = cm.CheckpointMeta.from_dict(saved)
    assert meta.extra == {"written_by_v9": {"x": 1}} and meta.to_dict() == saved


@pytest.mark.parametrize("key, value", [("step", "8"), ("step", True), ("files", []),
                                        ("model_only", "yes"), ("config", 3),
                                        ("architecture", [1]), ("consumed_samples", None)])
def test_a_malformed_field_is_one_line_naming_it(model_config, tmp_path, key, value):
    (tmp_path / "meta.json").write_text(json.dumps({**full_meta(model_config).to_dict(),
                                                    key: value}))
    with pytest.raises(CheckpointError) as err:
        read_meta(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'meta.json'}: {key} is ")
    assert "\n" not in str(err.value)


def test_the_writer_records_a_manifest_with_checksums_and_refuses_a_wrong_type(tmp_path):
    (tmp_path / "shard.distcp").write_bytes(b"x" * 100)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(b"spm")
    cm.write_meta(tmp_path, cm.CheckpointMeta(step=0, model_only=True))
    meta = read_meta(tmp_path)
    assert meta.version == cm.META_VERSION
    assert meta.files == {"shard.distcp": 100, "tokenizer/tokenizer.model": 3}
    assert sorted(meta.checksums["files"]) == sorted(meta.files)
    with pytest.raises(TypeError, match="step is '1'"):  # our own bug: not an operator's error
        cm.write_meta(tmp_path, cm.CheckpointMeta(step="1"))
    assert read_meta(tmp_path).step == 0  # the earlier meta.json is intact


def later_field(default):
    """SIGNATURE as it would be once a field is added to it. The only way to have a checkpoint
    older than a field of the current version is to declare one more (patched in, not mocked:
    the declared list is the thing under test)."""
    return (*cm.SIGNATURE, cm.SignatureField("qk_layernorm", lambda c: False, default))


def test_a_signature_field_added_later_reads_as_its_default(model_config, monkeypatch, tmp_path):
    older = full_meta(model_config)
    monkeypatch.setattr(cm, "SIGNATURE", later_field(default=False))
    assert "qk_layernorm" not in older.architecture
    assert cm.signature_differences(older.architecture, model_config) == {}
    check_compatible(older, model_config, "spm-sha256:0", tmp_path, "megatron", True)
    assert cm.model_config_from(older, tmp_path).num_layers == model_config.num_layers
    # A value saved explicitly still has to match.
    older.architecture["qk_layernorm"] = True
    with pytest.raises(CheckpointError, match="qk_layernorm: checkpoint True vs config False"):
        check_compatible(older, model_config, "spm-sha256:0", tmp_path, "megatron", True)


def test_a_signature_field_without_a_default_is_required(model_config, monkeypatch, tmp_path):
    older = full_meta(model_config)
    monkeypatch.setattr(cm, "SIGNATURE", later_field(default=cm._REQUIRED))
    with pytest.raises(CheckpointError, match="qk_layernorm: checkpoint None vs config False"):
        check_compatible(older, model_config, "spm-sha256:0", tmp_path, "megatron", True)
    with pytest.raises(CheckpointError, match="does not rebuild the saved architecture"):
        cm.model_config_from(older, tmp_path)


def test_one_tokenizer_check(model_config, tmp_path):
    meta = full_meta(model_config)
    with pytest.raises(CheckpointError, match="trained with tokenizer spm-sha256:0, but "
                                              "spm-sha256:1 is used here"):
        check_compatible(meta, model_config, "spm-sha256:1", tmp_path, "megatron", True)
    cm.check_tokenizer(None, "spm-sha256:1", "older")  # checkpoints that recorded none pass
