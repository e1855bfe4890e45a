"""Data parallelism and resharding keep the numbers.

- DP=2 follows DP=1's loss curve for the same global batch.
- A checkpoint saved at TP=2 (and one saved at PP=2) resumes at TP=1 x PP=1 with the next
  step's loss equal to the uninterrupted run's.
"""

import shutil

import pytest

from megatron_iiet.distributed import spawn_local
from tests.workers import zero_optimizer_state_bytes

from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses

pytestmark = pytest.mark.distributed


def test_dp2_matches_dp1(tiny_data, tmp_path):
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    check_ok(launch(base_overrides(tiny_data, one), nproc=1))
    check_ok(launch(base_overrides(tiny_data, two), nproc=2))
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])


@pytest.mark.parametrize("layout", [{"parallel.tensor": 2}, {"parallel.pipeline": 2}],
                         ids=["from_tp2", "from_pp2"])
def test_resume_with_another_layout(tiny_data, tmp_path, layout):
    steps = {"schedule.train_steps": 5, "checkpoint.save_interval": 4}
    sharded = tmp_path / "sharded"
    check_ok(launch(base_overrides(tiny_data, sharded, **steps, **layout), nproc=2))
    reference = train_losses(sharded)

    resumed = tmp_path / "single"
    ckpt_root = resumed / "checkpoints"
    ckpt_root.mkdir(parents=True)
    shutil.copytree(sharded / "checkpoints" / "iter_0000004", ckpt_root / "iter_0000004")
    (ckpt_root / "latest").write_text("iter_0000004")
    check_ok(launch(base_overrides(tiny_data, resumed, **steps), nproc=1))
    assert records(resumed, "resume")[0]["step"] == 4
    got = train_losses(resumed)
    assert sorted(got) == [5]
    assert abs(got[5] - reference[5]) <= 1e-5 * abs(reference[5]), (got[5], reference[5])


def test_zero_shards_optimizer_state_over_dp():
    """Per-rank optimizer state under ZeRO-1/2/3 halves when DP goes from 1 to 2."""
    stages = [1, 2, 3]
    one = spawn_local(zero_optimizer_state_bytes, 1, stages=stages)[0]
    two = spawn_local(zero_optimizer_state_bytes, 2, stages=stages)
    for stage in stages:
        assert one[stage] > 0
        for rank in two:
            assert rank[stage] == pytest.approx(one[stage] / 2, rel=0.05), (stage, one, two)
