"""Resuming with a changed config (docs/training.md, "Resuming with a changed config").

The data order is replayed directly: the datasets a run builds are asked which sample sits at
each global position, for runs of other lengths and batch sizes. The schedule and the refusals
are checked on real runs of pretrain_iiet.py.
"""

import math
from pathlib import Path

import numpy as np
import pytest

from tests.training.conftest import base_overrides, check_ok, launch, records

SEQ = 32


def _datasets(tiny_data, tmp_path, legacy=False, **extra):
    from megatron_iiet.training.config import load_config
    from megatron_iiet.training.data import build_datasets, resolve_sources

    cfg = load_config(None, base_overrides(tiny_data, tmp_path / "run", **extra))
    train, _ = build_datasets(cfg, resolve_sources(cfg), legacy_order=legacy)
    return cfg, train


def _tokens(dataset, positions):
    return [np.asarray(dataset[int(i)]["tokens"]).tobytes() for i in positions]


def test_sample_order_does_not_depend_on_run_length_or_batch_size(tiny_data, tmp_path):
    _, short = _datasets(tiny_data, tmp_path, **{"schedule.train_steps": 10})
    epoch = len(short)  # a short run: one epoch, megatron's own order
    steps = 3 * epoch // 8  # global batch 8: ~3 epochs
    _, long = _datasets(tiny_data, tmp_path, **{"schedule.train_steps": steps,
                                                 "parallel.global_batch_size": 8})
    assert len(long) >= steps * 8 > 2 * epoch
    first = range(0, epoch, max(1, epoch // 200))
    assert _tokens(short, first) == _tokens(long, first), "the first epoch moved"
    # the legacy order (megatron sized for the whole run) reshuffles the first epoch: what
    # resuming a 1-epoch run with a longer schedule or larger batch used to do
    _, legacy = _datasets(tiny_data, tmp_path, legacy=True,
                          **{"schedule.train_steps": steps, "parallel.global_batch_size": 8})
    assert _tokens(short, first) != _tokens(legacy, first)
    # every epoch (chunk) is a permutation of the same samples: nothing repeats inside one
    from megatron_iiet.training.data import ChunkedOrder

    assert isinstance(long, ChunkedOrder)
    for chunk in long.chunks:
        index = np.asarray(chunk.shuffle_index)
        assert len(np.unique(index)) == len(index) == epoch
    assert not np.array_equal(long.chunks[0].shuffle_index, long.chunks[1].shuffle_index)


def test_batch_size_change_continues_the_stream_without_repeats(tiny_data, tmp_path):
    """4 steps of 4 samples, then 6 steps of 8: the run reads positions [0, 16) then [16, 64)
    of one order, which a 64-sample uninterrupted run reads too."""
    from megatron_iiet.training.resume import ResumePoint, samples_needed
    from megatron_iiet.training.config import load_config

    cfg = load_config(None, base_overrides(tiny_data, tmp_path / "r", **{
        "schedule.train_steps": 10, "parallel.global_batch_size": 8}))
    point = ResumePoint(step=4, consumed_samples=16)
    assert samples_needed(cfg, point) == 16 + 6 * 8
    _, before = _datasets(tiny_data, tmp_path, **{"schedule.train_steps": 4,
                                                   "parallel.global_batch_size": 4})
    _, after = _datasets(tiny_data, tmp_path, **{"schedule.train_steps": 10,
                                                  "parallel.global_batch_size": 8})
    seen = _tokens(before, range(16)) + _tokens(after, range(16, 64))
    assert seen == _tokens(after, range(64))
    assert len(set(before.shuffle_index[:16]) | set(after.shuffle_index[16:64])) == 64


def _lr_by_step(log_dir):
    return {r["step"]: r["lr"] for r in records(log_dir, "train")}


def test_extended_schedule_takes_effect_and_batch_change_is_applied(tiny_data, tmp_path):
    common = {"schedule.warmup_steps": 2, "logging.log_interval": 1, "eval.interval": 0}
    run = tmp_path / "extended"
    check_ok(launch(base_overrides(tiny_data, run, **common, **{"schedule.train_steps": 6})))
    assert _lr_by_step(run)[6] == pytest.approx(3e-4)  # the cosine's floor at the old end
    proc = launch(base_overrides(tiny_data, run, **common, **{
        "schedule.train_steps": 10, "parallel.global_batch_size": 8}))
    check_ok(proc)
    resume = records(run, "resume")[-1]
    assert resume["step"] == 6
    assert "schedule.train_steps 6 -> 10" in resume["config_changes"]
    assert "parallel.global_batch_size 4 -> 8" in resume["config_changes"]
    # the new schedule at steps 7..10: the cosine of a 10-step run, not 4 steps flat at min_lr
    lr = _lr_by_step(run)
    for step in range(7, 11):
        progress = (step - 2) / (10 - 2)
        expected = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * progress))
        assert lr[step] == pytest.approx(expected, rel=1e-6), (step, lr[step], expected)
    assert lr[7] > 3e-4 * 2
    ends = records(run, "end")
    assert ends[-1]["step"] == 10 and ends[-1]["finished"]


def test_seq_length_change_is_refused_unless_model_only(tiny_data, tmp_path):
    run = tmp_path / "seq"
    check_ok(launch(base_overrides(tiny_data, run, **{"schedule.train_steps": 2,
                                                       "schedule.warmup_steps": 1})))
    proc = launch(base_overrides(tiny_data, run, **{"schedule.train_steps": 4,
                                                     "schedule.warmup_steps": 1,
                                                     "data.seq_length": 16}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "data.seq_length" in lines[0] and "load_model_only" in lines[0]
    assert "Traceback" not in proc.stderr
    other = tmp_path / "seq_model_only"
    check_ok(launch(base_overrides(tiny_data, other, **{
        "schedule.train_steps": 2, "schedule.warmup_steps": 1, "data.seq_length": 16,
        "checkpoint.load": str(Path(run) / "checkpoints"), "checkpoint.load_model_only": True})))


def test_resume_point_rules():
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training.checkpoint_meta import CheckpointMeta
    from megatron_iiet.training.config import load_config
    from megatron_iiet.training.data import ORDER_VERSION
    from megatron_iiet.training.resume import resume_point

    cfg = load_config(None, ["schedule.train_steps=40", "schedule.warmup_steps=2"])
    saved = cfg.to_dict()
    saved["schedule"] = {**saved["schedule"], "train_steps": 30}
    meta = {"step": 30, "consumed_samples": 30 * cfg.parallel.global_batch_size,
            "config": saved, "data_order": ORDER_VERSION}
    point = resume_point(CheckpointMeta.from_dict(meta), cfg, model_only=False)
    assert point.changes == ["schedule.train_steps 30 -> 40"] and not point.legacy_order
    # an older checkpoint (no data_order): its order depends on the run's size, so refused
    legacy = {k: v for k, v in meta.items() if k != "data_order"}
    with pytest.raises(BadInput, match="reshuffle"):
        resume_point(CheckpointMeta.from_dict(legacy), cfg, model_only=False)
    unchanged = {**legacy, "config": cfg.to_dict()}
    assert resume_point(CheckpointMeta.from_dict(unchanged), cfg, model_only=False).legacy_order
    short = load_config(None, ["schedule.train_steps=20", "schedule.warmup_steps=2"])
    with pytest.raises(BadInput, match="below the step"):
        resume_point(CheckpointMeta.from_dict(meta), short, model_only=False)
    assert resume_point(CheckpointMeta.from_dict(meta), short, model_only=True).step == 0
