"""Checkpoints survive operator mistakes and broken files (issue 9, cases 1, 2, 10, 11, 13, 14;
issue 28, cases 5, 6, 12, 14).

One reference run (10 steps, a checkpoint every 2, keep_last 3: iter_6, iter_8, iter_10) is
copied and damaged in each test; a resume must continue from the newest complete checkpoint
with losses bit-identical to the reference, or stop with one line and exit 2; nothing already
saved is deleted.
"""

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_iiet.training.checkpoint_index import (
    CheckpointError, defect, newest_complete, read_latest, resolve_checkpoint)
from megatron_iiet.training.checkpointing import CheckpointManager
from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses
from tests.training.faults import (
    Payload, copy_checkpoints, forge_manifest, listing, one_line_error, tmpfs)

SAVES = {"schedule.train_steps": 10, "checkpoint.save_interval": 2, "checkpoint.keep_last": 3}
ALL_SAVES = ["iter_0000006", "iter_0000008", "iter_0000010", "latest"]


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    check_ok(launch(base_overrides(tiny_data, run, **SAVES)))
    assert listing(run / "checkpoints") == ALL_SAVES
    return run


def _resume(tiny_data, run, **extra):
    return launch(base_overrides(tiny_data, run, **{**SAVES, **extra}))


def _resumed_exactly(proc, run, reference, from_step):
    check_ok(proc)
    assert records(run, "resume")[-1]["step"] == from_step
    ref = train_losses(reference)
    assert train_losses(run) == {s: ref[s] for s in range(from_step + 1, 11)}
    assert records(run, "end")[-1]["params_sha256"] == records(reference, "end")[-1]["params_sha256"]


# ---- case 1: retention and fresh starts -------------------------------------------------------

def test_fresh_start_into_a_directory_of_another_run_refuses_and_deletes_nothing(
        tiny_data, reference, tmp_path):
    run = copy_checkpoints(reference, tmp_path / "run")
    proc = _resume(tiny_data, run, **{"checkpoint.load": None})
    one_line_error(proc, "iter_0000006, iter_0000008, iter_0000010", "checkpoint.overwrite")
    assert listing(run / "checkpoints") == ALL_SAVES
    assert not records(run, "train")


def test_overwrite_replaces_the_old_run_once_the_new_one_has_a_checkpoint(
        tiny_data, reference, tmp_path):
    run = copy_checkpoints(reference, tmp_path / "run")
    proc = _resume(tiny_data, run, **{"checkpoint.load": None, "checkpoint.overwrite": True,
                                      "schedule.train_steps": 4, "checkpoint.keep_last": 2})
    check_ok(proc)
    assert "removed iter_0000010 of the overwritten run" in proc.stdout
    ckpts = run / "checkpoints"
    assert listing(ckpts) == ["iter_0000002", "iter_0000004", "latest"]
    assert newest_complete(ckpts) == ckpts / "iter_0000004"
    assert (ckpts / "latest").read_text() == "iter_0000004"


def _complete_checkpoint(root: Path, step: int) -> Path:
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "files": {}}))
    return path


def test_retention_never_deletes_the_checkpoint_just_saved_nor_newer_ones(tmp_path):
    # the scenario of the report: iter_6 and iter_8 of another run, keep_last 2, iter_2 saved
    manager = CheckpointManager(str(tmp_path), keep_last=2, log=lambda _: None)
    for step in (1, 6, 8, 2):
        _complete_checkpoint(tmp_path, step)
    manager._retire(tmp_path / "iter_0000002")
    assert listing(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000006", "iter_0000008"]
    _complete_checkpoint(tmp_path, 3)
    manager._retire(tmp_path / "iter_0000003")  # keeps itself and the newest older one
    assert listing(tmp_path) == ["iter_0000002", "iter_0000003", "iter_0000006", "iter_0000008"]
    keep_all = CheckpointManager(str(tmp_path), keep_last=0, log=lambda _: None)
    _complete_checkpoint(tmp_path, 4)
    keep_all._retire(tmp_path / "iter_0000004")
    assert len(listing(tmp_path)) == 5


# ---- cases 2 and 13: missing or broken `latest`, broken newest checkpoint ----------------------

@pytest.mark.parametrize("pointer", ["missing", "binary"])
def test_lost_latest_resumes_from_the_newest_complete_checkpoint(
        tiny_data, reference, tmp_path, pointer):
    run = copy_checkpoints(reference, tmp_path / "run")
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "iter_0000010")  # so that the resume has steps left to compare
    if pointer == "missing":
        (ckpts / "latest").unlink()
    else:
        (ckpts / "latest").write_bytes(os.urandom(64) + b"\x00\xff")
    proc = _resume(tiny_data, run)
    assert f"{ckpts / 'latest'}:" in proc.stdout
    assert "resuming from the newest complete checkpoint iter_0000008" in proc.stdout
    _resumed_exactly(proc, run, reference, 8)


def _truncate(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


BREAKS = {
    "distcp": lambda ckpt: _truncate(sorted(ckpt.glob("*.distcp"))[0]),
    "common.pt": lambda ckpt: _truncate(ckpt / "common.pt"),
    "rng": lambda ckpt: _truncate(ckpt / "rng" / "rank0.pt"),
    "meta.json": lambda ckpt: (ckpt / "meta.json").write_text('{"step": 10, "consumed'),
}


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_broken_newest_checkpoint_falls_back_to_the_previous_complete_one(
        tiny_data, reference, tmp_path, broken):
    run = copy_checkpoints(reference, tmp_path / "run")
    newest = run / "checkpoints" / "iter_0000010"
    BREAKS[broken](newest)
    assert defect(newest) is not None
    proc = _resume(tiny_data, run)
    assert f"skipping broken checkpoint iter_0000010: {newest}" in proc.stdout, proc.stdout[-2000:]
    _resumed_exactly(proc, run, reference, 8)
    assert defect(newest) is None, "the broken checkpoint was not replaced by the new save"


def test_explicitly_loading_a_broken_checkpoint_names_the_file(tiny_data, reference, tmp_path):
    run = copy_checkpoints(reference, tmp_path / "run")
    newest = run / "checkpoints" / "iter_0000010"
    BREAKS["distcp"](newest)
    proc = _resume(tiny_data, tmp_path / "other", **{"checkpoint.load": str(newest)})
    one_line_error(proc, str(sorted(newest.glob("*.distcp"))[0]), "truncated")


def test_checkpoint_index_names_each_defect(tmp_path):
    good = _complete_checkpoint(tmp_path, 2)
    (good / "common.pt").write_bytes(b"x" * 10)
    meta = json.loads((good / "meta.json").read_text())
    (good / "meta.json").write_text(json.dumps({**meta, "files": {"common.pt": 10}}))
    assert defect(good) is None and resolve_checkpoint(tmp_path) == good
    (good / "common.pt").write_bytes(b"x" * 4)
    assert "common.pt: truncated or altered (4 bytes, 10 when saved)" in defect(good)
    (good / "common.pt").unlink()
    assert defect(good).endswith("common.pt: missing")
    (good / "meta.json").write_bytes(b"\x89\x00binary")
    assert "meta.json: not valid JSON" in defect(good)
    with pytest.raises(CheckpointError, match="meta.json: not valid JSON"):
        resolve_checkpoint(good)
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")
    assert read_latest(tmp_path) == (None, f"{tmp_path / 'latest'}: unreadable (not a checkpoint name)")


# ---- case 14: another engine's checkpoint ------------------------------------------------------

def test_megatron_checkpoint_under_deepspeed_says_the_engines_differ_and_how_to_continue(
        tiny_data, reference, tmp_path):
    ckpts = str(reference / "checkpoints")
    settings = {"parallel.engine": "deepspeed", "checkpoint.load": ckpts,
                "schedule.train_steps": 2, "schedule.warmup_steps": 1}
    proc = launch(base_overrides(tiny_data, tmp_path / "ds", **settings))
    one_line_error(proc, "written by the megatron engine", "parallel.engine=deepspeed",
                   "checkpoint.load_model_only=true")
    proc = launch(base_overrides(tiny_data, tmp_path / "ds", **settings,
                                 **{"checkpoint.load_model_only": True}))
    check_ok(proc)
    assert records(tmp_path / "ds", "resume")[-1]["step"] == 0
    assert sorted(train_losses(tmp_path / "ds")) == [1, 2]


# ---- cases 10 and 11: full and read-only disks -------------------------------------------------

def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_says_so(
        tiny_data, reference, tmp_path):
    size = records(reference, "checkpoint")[-1]["bytes"]
    run = tmp_path / "run"
    with tmpfs(tmp_path / "small", f"size={int(size * 1.5) // 4096 * 4096}") as disk:
        proc = launch(base_overrides(tiny_data, run, **{
            "checkpoint.dir": str(disk), "schedule.train_steps": 6, "checkpoint.save_interval": 2,
            "checkpoint.keep_last": 1}))
        one_line_error(proc, f"no space left on {disk} while saving iter_0000004",
                       "iter_0000002 and `latest` are intact")
        assert listing(disk) == ["iter_0000002", "latest"]
        assert (disk / "latest").read_text() == "iter_0000002"
        assert defect(disk / "iter_0000002") is None


def test_full_logging_disk_is_one_line(tiny_data, tmp_path):
    with tmpfs(tmp_path / "logs", "size=64k") as disk:
        fd = os.open(disk / "filler", os.O_CREAT | os.O_WRONLY)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)
        proc = launch(base_overrides(tiny_data, disk / "run", **{
            "checkpoint.dir": str(tmp_path / "ckpt")}))
        one_line_error(proc, f"no space left on {disk / 'run'}")
        assert listing(disk) == ["filler", "run"]


def test_read_only_checkpoint_directory_is_one_line_before_training(tiny_data, tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=64k") as disk:
        proc = launch(base_overrides(tiny_data, tmp_path / "run", **{
            "checkpoint.dir": str(disk)}))
        one_line_error(proc, f"cannot write to {disk}: read-only file system")
    assert not records(tmp_path / "run", "train")


# ---- issue 28, cases 5, 6, 12, 14: nothing read from a checkpoint runs; a changed byte is found;
# older checkpoints (no checksums, numpy RNG arrays, the legacy tokenizer fingerprint) resume --

def _newest_copy(reference, tmp_path) -> tuple[Path, Path]:
    run = copy_checkpoints(reference, tmp_path / "run")
    return run, run / "checkpoints" / "iter_0000010"


@pytest.mark.parametrize("planted", ["rng/rank0.pt", ".metadata"])
def test_a_planted_pickle_is_refused_at_resume_and_does_not_run(
        tiny_data, reference, tmp_path, planted):
    run, newest = _newest_copy(reference, tmp_path)
    marker = tmp_path / "payload-ran"
    if planted == ".metadata":  # torch's reader would pickle.load it
        (newest / planted).write_bytes(pickle.dumps(Payload(marker)))
    else:  # read with weights_only=False before
        torch.save({**torch.load(newest / planted, weights_only=True),
                    "python": Payload(marker)}, newest / planted)
    forge_manifest(newest)
    proc = _resume(tiny_data, run, **{"schedule.train_steps": 12})
    one_line_error(proc, f"{newest / planted}: refusing to unpickle it")
    assert not marker.exists(), "the planted code ran"


def test_planted_pickles_megatron_reads_are_refused_before_it_reads_them(reference, tmp_path):
    """The bytes items of *.distcp (torch's planner: weights_only=False) and common.pt."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_iiet.safe_pickle import read_dcp_metadata
    from megatron_iiet.training.checkpointing import verify_for_load

    marker = tmp_path / "payload-ran"
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    _, ckpt = _newest_copy(reference, tmp_path / "item")
    metadata = read_dcp_metadata(ckpt)
    item = next(i for i in metadata.storage_data
                if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    (ckpt / "__9_0.distcp").write_bytes(payload.getvalue())
    metadata.storage_data[item] = _StorageInfo("__9_0.distcp", 0, len(payload.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    forge_manifest(ckpt)
    with pytest.raises(CheckpointError, match=rf"__9_0.distcp \({item.fqn}\): refusing to unpickle"):
        verify_for_load(ckpt)
    _, ckpt = _newest_copy(reference, tmp_path / "common")
    (ckpt / "common.pt").write_bytes(payload.getvalue())
    forge_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"common.pt: refusing to unpickle"):
        verify_for_load(ckpt)
    assert not marker.exists(), "the planted code ran"


def test_a_same_size_change_inside_a_shard_fails_the_load_naming_it(tiny_data, reference, tmp_path):
    run, newest = _newest_copy(reference, tmp_path)
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert defect(newest) is None  # sizes alone cannot see it
    proc = _resume(tiny_data, tmp_path / "other", **{"checkpoint.load": str(newest)})
    one_line_error(proc, f"{shard}: altered since it was saved")


def test_a_checkpoint_of_the_previous_format_resumes_exactly(tiny_data, reference, tmp_path):
    """No checksums, numpy's RNG keys as a pickled ndarray, the legacy tokenizer fingerprint."""
    import numpy as np

    from megatron_iiet.data.tokenizer import Tokenizer
    from megatron_iiet.training.checkpoint_index import CHECKSUMS_KEY, manifest

    run = copy_checkpoints(reference, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "iter_0000010")
    older = run / "checkpoints" / "iter_0000008"
    rng = older / "rng" / "rank0.pt"
    state = torch.load(rng, weights_only=True)
    kind, keys, *rest = state["numpy"]
    torch.save({**state, "numpy": (kind, keys.numpy().astype(np.uint32), *rest)}, rng)
    meta = json.loads((older / "meta.json").read_text())
    assert meta.pop(CHECKSUMS_KEY)
    tokenizer = Tokenizer.from_path(tiny_data.tokenizer_model)
    assert meta["tokenizer_fingerprint"] == tokenizer.fingerprint != tokenizer.legacy_fingerprint
    meta.update(files=manifest(older), tokenizer_fingerprint=tokenizer.legacy_fingerprint)
    (older / "meta.json").write_text(json.dumps(meta))
    _resumed_exactly(_resume(tiny_data, run), run, reference, 8)


def test_a_checkpoint_before_the_typed_meta_resumes_exactly(tiny_data, reference, tmp_path):
    """Issue 28, the checkpoint contract: a meta.json without `version`, manifest, checksums,
    `skipped_steps` and the tokenizer path (fields added over time), and with a key of some
    newer version, still resumes, and the next save writes the current version."""
    from megatron_iiet.training.checkpoint_index import read_meta
    from megatron_iiet.training.checkpoint_meta import META_VERSION

    run = copy_checkpoints(reference, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "iter_0000010")
    older = run / "checkpoints" / "iter_0000008"
    meta = json.loads((older / "meta.json").read_text())
    for later in ("version", "files", "checksums", "skipped_steps", "tokenizer"):
        meta.pop(later)
    (older / "meta.json").write_text(json.dumps({**meta, "from_a_newer_version": [1]}))
    _resumed_exactly(_resume(tiny_data, run), run, reference, 8)
    assert read_meta(run / "checkpoints" / "iter_0000010").version == META_VERSION
