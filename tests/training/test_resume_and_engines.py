"""Resume is exact, and both engines follow the same trajectory.

For each engine, on 2 ranks (DP=2; ZeRO-1 for DeepSpeed), with dropout on and 2 data-loader
workers: 2N steps uninterrupted vs N steps, stop (schedule.exit_interval), resume to 2N. The two
uninterrupted runs (same init, data and dropout streams) also compare the engines.
"""

import pytest

from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses

N = 10
ENGINES = ("megatron", "deepspeed")
pytestmark = pytest.mark.distributed


def _settings(engine):
    return {"parallel.engine": engine, "schedule.train_steps": 2 * N,
            "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1,
            "data.num_workers": 2, "parallel.zero_stage": 1}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    out = {}
    for engine in ENGINES:
        root = tmp_path_factory.mktemp(f"resume_{engine}")
        whole, split = root / "whole", root / "split"
        check_ok(launch(base_overrides(tiny_data, whole, **_settings(engine)), nproc=2))
        check_ok(launch(base_overrides(tiny_data, split, **_settings(engine),
                                       **{"schedule.exit_interval": N}), nproc=2))
        first_part = train_losses(split)
        check_ok(launch(base_overrides(tiny_data, split, **_settings(engine)), nproc=2))
        out[engine] = (whole, split, first_part)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_resumed_run_is_bitwise_identical(runs, engine):
    whole, split, first_part = runs[engine]
    assert sorted(first_part) == list(range(1, N + 1)), "the first part did not stop at N"
    assert records(split, "resume") and records(split, "resume")[0]["step"] == N
    assert train_losses(split) == train_losses(whole), f"{engine}: loss curves differ"
    end_whole, end_split = records(whole, "end")[-1], records(split, "end")[-1]
    assert end_whole["step"] == end_split["step"] == 2 * N
    assert end_whole["params_sha256"] == end_split["params_sha256"], f"{engine}: parameters differ"


def test_engines_reach_the_same_loss(runs):
    mega, ds = (train_losses(runs[e][0]) for e in ENGINES)
    assert abs(mega[1] - ds[1]) <= 1e-6, "same init, data and dropout must give the same first loss"
    assert abs(mega[2 * N] - ds[2 * N]) <= 1e-4, (mega[2 * N], ds[2 * N])
    assert mega[2 * N] < mega[1] - 0.3, "training did not reduce the loss"
