"""parallel.flush_denormals: on the CPU, training flushes subnormal floats to zero on every
intra-op thread (the switch is per thread), and leaves the process's mode as it found it."""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from megatron_iiet.platform import (
    _PROBE_SIZE, _subnormals_surviving, cpu_denormals_flushed, cuda_available)
from megatron_iiet.training.callbacks import Callback

pytestmark = pytest.mark.skipif(cuda_available(), reason="the switch is CPU-only")


def test_the_flush_reaches_openmp_threads_started_before_it_and_is_undone_after():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _subnormals_surviving()  # also starts the 2-thread pool, in the old mode
        with cpu_denormals_flushed(True) as flushed:
            assert flushed and _subnormals_surviving() == 0
        assert _subnormals_surviving() == before
        with cpu_denormals_flushed(False) as flushed:
            assert not flushed and _subnormals_surviving() == _PROBE_SIZE
        assert _subnormals_surviving() == before
    finally:
        torch.set_num_threads(threads)


class SubnormalsSeen(Callback):
    def on_step_end(self, trainer, event):
        trainer.reporter.event("subnormals", event.step, surviving=_subnormals_surviving())


def train_and_probe(overrides: list) -> dict:
    from megatron_iiet.run import train
    from megatron_iiet.training.config import load_config

    started = _subnormals_surviving()  # the OpenMP pool exists before train() sets the mode
    train(load_config(None, overrides), callbacks=(SubnormalsSeen(),))
    return {"started": started, "after": _subnormals_surviving()}


@pytest.mark.distributed
@pytest.mark.parametrize("flush", [True, False])
def test_training_runs_with_the_configured_mode_on_both_threads(tiny_data, tmp_path, flush):
    from tests.training.conftest import base_overrides, records

    log = tmp_path / "run"
    overrides = base_overrides(tiny_data, log, **{"parallel.flush_denormals": flush,
                                                  "schedule.train_steps": 2,
                                                  "schedule.warmup_steps": 1})
    r = spawn_local(train_and_probe, 1, threads_per_rank=2, overrides=overrides)[0]
    seen = [x["surviving"] for x in records(log, "subnormals")]
    assert seen == [0 if flush else _PROBE_SIZE] * 2
    assert r["started"] == r["after"] == _PROBE_SIZE  # a fresh process flushes nothing
