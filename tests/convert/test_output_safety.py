"""What a conversion may replace (issue 28): never its source or a folder around or inside it,
whatever the flags; with --force only an earlier export, as the converter wrote it (its
marker file lists what that was). Exported files get the mode a plain write gives them, and
weights beyond the --max-abs-weight bound are refused by name. Real checkpoints, real files."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from megatron_iiet.hf.checks import EXPORT_MARKER
from megatron_iiet.hf.convert import ConversionError, export_to_hf, import_from_hf
from tests.convert.conftest import assert_nothing_written, assert_refused, hf_state, run_cli
from tests.convert.test_corrupt_input import (NAN_TENSOR, NAN_TENSOR_IN_MEGATRON, copy_hf_folder,
                                             rewrite_weights)

pytestmark = pytest.mark.distributed  # uses the spawned checkpoint fixtures

SOURCE = "vanilla-tp1"  # its newest checkpoint is iter_0000007
HUGE = 3e30


def run_folder(checkpoints, tmp_path: Path) -> Path:
    """A run folder as training leaves it: checkpoints/, metrics and TensorBoard events."""
    run = tmp_path / "run"
    shutil.copytree(checkpoints[0] / SOURCE, run / "checkpoints")
    (run / "metrics.jsonl").write_text('{"step": 7, "loss": 5.1}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\x00events")
    return run


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def modes(folder: Path) -> dict:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


def no_temp_folders_beside(dst: Path) -> None:
    assert [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")] == []


# ---- 1: the source and what surrounds it are never an output ---------------------------------
def test_cli_refuses_to_export_onto_its_run_folder_even_with_force(checkpoints, tmp_path):
    run = run_folder(checkpoints, tmp_path)
    before = snapshot(run)
    assert_refused(run_cli("megatron-to-hf", run / "checkpoints", run, "--force", "--quiet"),
                   run, "contains the source")
    assert snapshot(run) == before
    no_temp_folders_beside(run)


def test_outputs_on_or_around_the_source_are_refused_both_ways(checkpoints, converted,
                                                               tmp_path):
    run = run_folder(checkpoints, tmp_path)
    before = snapshot(run)
    ckpts = run / "checkpoints"
    (tmp_path / "linked").symlink_to(run)
    for src, dst, relation in ((ckpts, ckpts, "is"), (ckpts / "iter_0000007", run, "contains"),
                               (ckpts, tmp_path / "linked", "contains"),
                               (ckpts, ckpts / "iter_0000007", "lies inside"),
                               (ckpts, ckpts / "hf", "lies inside")):
        for force in (False, True):
            with pytest.raises(ConversionError, match=f"the output {relation} the source"):
                export_to_hf(src, dst, force=force, with_tokenizer=False)
    assert snapshot(run) == before
    hf = Path(shutil.copytree(converted / "hf" / SOURCE, tmp_path / "hf"))
    hf_before = snapshot(hf)
    for dst, relation in ((hf, "is"), (tmp_path, "contains"), (hf / "megatron", "lies inside")):
        with pytest.raises(ConversionError, match=f"the output {relation} the source"):
            import_from_hf(hf, dst, force=True)
    assert snapshot(hf) == hf_before
    assert_refused(run_cli("hf-to-megatron", hf, hf, "--force", "--quiet"), hf, "is the source")
    assert snapshot(hf) == hf_before


# ---- 1: --force replaces an earlier export, and nothing else ----------------------------------
def test_force_replaces_only_an_earlier_export(checkpoints, tmp_path):
    src = checkpoints[0] / SOURCE
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = assert_refused(run_cli("megatron-to-hf", src, out, "--force", "--no-tokenizer",
                                  "--quiet"), out, EXPORT_MARKER, "--force replaces only")
    assert "not an earlier export" in line
    assert snapshot(out) == {"notes.txt": b"mine"}
    (out / "notes.txt").unlink()
    (out / EXPORT_MARKER).write_text("{broken")  # a marker that says nothing does not count
    with pytest.raises(ConversionError, match="not an earlier export"):
        export_to_hf(src, out, force=True, with_tokenizer=False)
    (out / EXPORT_MARKER).unlink()

    export_to_hf(src, out, force=True, with_tokenizer=False)  # an empty folder may go
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {EXPORT_MARKER}
    assert "model.safetensors" in marker["files"] and marker["kind"] == "hf"
    first = (out / "model.safetensors").stat().st_ino
    export_to_hf(src, out, force=True, with_tokenizer=False)  # its own export: replaced
    assert (out / "model.safetensors").stat().st_ino != first
    no_temp_folders_beside(out)

    (out / "notes.txt").write_text("added after the export")
    with pytest.raises(ConversionError, match="holds notes.txt that the export did not write"):
        export_to_hf(src, out, force=True, with_tokenizer=False)
    assert (out / "notes.txt").read_text() == "added after the export"


def test_force_never_replaces_a_training_run_grown_from_an_import(converted, tmp_path):
    """hf-to-megatron's root, later used as a run's checkpoint.dir: its new checkpoints are not
    the converter's to delete."""
    src = converted / "hf" / SOURCE
    root = tmp_path / "imported"
    import_from_hf(src, root)
    assert json.loads((root / EXPORT_MARKER).read_text())["kind"] == "megatron"
    import_from_hf(src, root, force=True)  # an unchanged import: replaced
    (root / "iter_0000010").mkdir()
    (root / "iter_0000010" / "meta.json").write_text("{}")
    with pytest.raises(ConversionError, match="holds iter_0000010 that the export did not"):
        import_from_hf(src, root, force=True)
    assert (root / "iter_0000010" / "meta.json").is_file()


# ---- 8: file modes ------------------------------------------------------------------------------
def test_exported_files_get_the_mode_of_a_plain_write(checkpoints, converted, tmp_path):
    plain = 0o666 & ~_current_umask()
    assert set(modes(converted / "hf" / SOURCE).values()) == {plain}, modes(converted / "hf" / SOURCE)
    previous = os.umask(0o007)  # a group-shared project folder
    try:
        out = tmp_path / "shared"
        export_to_hf(checkpoints[0] / SOURCE, out)
    finally:
        os.umask(previous)
    assert set(modes(out).values()) == {0o660}, modes(out)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- 13: weights beyond the bound ---------------------------------------------------------------
@pytest.fixture(scope="module")
def huge_hf(hf_source, tmp_path_factory):
    """hf_source with one finite but absurd weight, as a damaged or diverged model has."""
    def plant(tensors):
        tensors[NAN_TENSOR][2, 3] = HUGE

    folder = copy_hf_folder(hf_source, tmp_path_factory.mktemp("huge"))
    rewrite_weights(folder, plant)
    return folder


def test_weights_beyond_the_bound_are_refused_both_ways(huge_hf, tmp_path):
    line = assert_refused(run_cli("hf-to-megatron", huge_hf, tmp_path / "meg", "--quiet"),
                          huge_hf, f"first: {NAN_TENSOR}", "3e+30", "--max-abs-weight")
    assert "1 of " in line and "beyond the bound 10000" in line
    assert_nothing_written(tmp_path / "meg")
    # Raised on purpose, the bound lets it through, and the other direction refuses it too.
    proc = run_cli("hf-to-megatron", huge_hf, tmp_path / "meg", "--max-abs-weight", "1e31",
                   "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_refused(run_cli("megatron-to-hf", tmp_path / "meg", tmp_path / "hf", "--quiet"),
                   tmp_path / "meg", NAN_TENSOR_IN_MEGATRON, "--max-abs-weight")
    assert_nothing_written(tmp_path / "hf")
    proc = run_cli("megatron-to-hf", tmp_path / "meg", tmp_path / "hf", "--max-abs-weight",
                   "inf", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hf_state(tmp_path / "hf")[NAN_TENSOR][2, 3] == torch.tensor(HUGE)
