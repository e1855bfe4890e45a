"""Weights & Biases as an optional sink, run for real in its offline mode (no network): the
values it recorded are read back from its own .wandb file and equal metrics.jsonl's, and a
resumed run continues the same W&B run."""

import json
import struct
from pathlib import Path

import pytest

from tests.training.conftest import base_overrides, check_ok, launch, records

wandb = pytest.importorskip("wandb", reason="wandb is an optional sink (pip install wandb)")


def _history(run_file: Path) -> list[dict]:
    """The history rows of a .wandb file: W&B's 7-byte header, then LevelDB-log records (32 KiB
    blocks, 7-byte chunk headers: crc32, length, type full/first/middle/last) of protobuf
    Records. Read here because wandb 0.31 moved its own reader into its Go core."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, chunks, pending = run_file.read_bytes(), 32768, 7, [], b""
    assert raw.startswith(b":W&B")
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            chunks.append(pending + data)
            pending = b""
        else:
            pending += data
    rows = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def test_offline_wandb_records_what_metrics_jsonl_does_and_resume_continues_the_run(
        tiny_data, tmp_path):
    run = tmp_path / "run"
    settings = {"schedule.train_steps": 4, "logging.wandb_project": "iiet-test",
                "logging.wandb_mode": "offline", "eval.interval": 2}
    env = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    check_ok(launch(base_overrides(tiny_data, run, **settings, **{"schedule.exit_interval": 2}),
                    env=env))
    check_ok(launch(base_overrides(tiny_data, run, **settings), env=env))
    assert records(run, "resume")[-1]["step"] == 2
    run_id = (run / "wandb_run_id").read_text().strip()
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, "the resumed job should continue the same W&B run id"
    logged = {}
    for f in files:
        for row in _history(f):
            if "train/loss" in row:
                logged[row["_step"]] = row["train/loss"]
    expected = {r["step"]: r["loss"] for r in records(run, "train")}
    assert logged == pytest.approx(expected, rel=1e-12) and sorted(logged) == [1, 2, 3, 4]
    valid = [row["valid/loss"] for f in files for row in _history(f) if "valid/loss" in row]
    assert valid == pytest.approx([r["loss"] for r in records(run, "valid")])


def test_unknown_wandb_mode_is_one_line(tiny_data, tmp_path):
    proc = launch(base_overrides(tiny_data, tmp_path / "bad", **{
        "logging.wandb_project": "p", "logging.wandb_mode": "sometimes"}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "logging.wandb_mode" in proc.stderr
